"""GPU benchmarks: kvpipe against the baselines a user would pick, measured in the same run."""
