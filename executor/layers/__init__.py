"""The model in pieces: the Hugging Face adapter that runs embed, qkv, attention per head group,
mlp and head by the model's own modules, the exact chunked attention kernels, the fused decode
pieces, and the model loader (local weights or seeded random ones)."""
