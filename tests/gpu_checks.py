"""Checks for GPU tests that do not trust the code under test: whether host memory is page-locked
by a cudaHostRegister, asked of the driver itself (torch's is_pinned() knows only its own
allocator's pinned blocks, so registered memory reads False there)."""
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
    return err == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
