"""CUDA-graph replay of decode steps: capture once per shape bucket, the step's inputs in static
device buffers, and the device-held counts that let sparse steps replay."""
