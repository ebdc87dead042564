"""One-off investigations kept for reference (not installed, not maintained): see README.md."""
