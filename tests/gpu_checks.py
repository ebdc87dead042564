"""Checks for GPU tests that do not trust the code under test: whether host memory is page-locked
by a cudaHostRegister, asked of the driver itself (torch's is_pinned() knows only its own
allocator's pinned blocks, so registered memory reads False there)."""
import ctypes

import torch

CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712   # cudaError_t of a second cudaHostRegister of a range


def is_registered(t: torch.Tensor) -> bool:
    """True when the driver already holds `t`'s bytes registered (a second registration fails
    with 712); a probe that succeeds is undone at once."""
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err == 0:
        cudart.cudaHostUnregister(t.data_ptr())
        return False
    _clear_last_error()
    return err == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED


def _clear_last_error() -> None:
    """A failed runtime call stays the thread's "last error" until read, and torch's next kernel
    launch check raises it (the H200 run of 2026-11-30: an AcceleratorError at the next
    torch.randn on CUDA, in whichever test came next). Read it from the libcudart torch loaded."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    for path in paths:
        ctypes.CDLL(path).cudaGetLastError()
