"""LOSSY quantisation (`--lossy int8|int4`): group-wise quantise/dequantise, the block records and
their compiled and Triton decodes, the quantised homes of the offloaded units, and the in-run
error probe."""
