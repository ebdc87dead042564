"""The disk tier: one pre-allocated O_DIRECT file of checksummed blocks per run, its I/O backends
(POSIX or kvikio), and its framed variant that stores codec-encoded blocks."""
