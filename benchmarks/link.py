"""The floor's denominator, measured in the same run: pinned host <-> device copy bandwidth for
large copies (median of several 1 GiB copies), and bf16 GEMM rate. Prints one JSON object."""
from __future__ import annotations

import json
import statistics

import torch


def copy_rate(src: torch.Tensor, dst: torch.Tensor, reps: int = 5) -> float:
    rates = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        rates.append(src.numel() * src.element_size() / (a.elapsed_time(b) / 1e3))
    return statistics.median(rates[1:])   # the first copy warms up


def gemm_rate(n: int = 8192, reps: int = 10) -> float:
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        x @ y
    b.record()
    b.synchronize()
    return 2 * n**3 * reps / (a.elapsed_time(b) / 1e3)


def main() -> None:
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True).random_()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "h2d_bytes_per_s": copy_rate(host, dev), "d2h_bytes_per_s": copy_rate(dev, host),
           "bf16_gemm_flops_per_s": gemm_rate()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
