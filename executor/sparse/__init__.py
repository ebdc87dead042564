"""LOSSY sparse decode (`--sparse F`): the low-bit key sketch, the token ranking and selection
(torch and Triton), the selection state of the offloaded units, the gather of the selected rows,
and the in-run recall probe."""
