"""How many GPUs this process sees, asked of the CUDA driver, not of torch.

A notebook's first cell starts its engines: `cluster.start()` needs the GPU count to know how many. Asking torch
(`torch.cuda.device_count()`) imports torch in the notebook's kernel first, ~1-2 s before any engine is spawned
(the `checks` phase of `handle.startup_s`). The driver gives the same number without it: torch's count is the CUDA
runtime's `cudaGetDeviceCount`, which is the driver's `cuInit` + `cuDeviceGetCount`, honouring
CUDA_VISIBLE_DEVICES in all its forms (indices, UUIDs, MIG instances). Where libcuda is not there to ask (a CPU
machine, or a GPU stack that is not CUDA's), torch is asked, as before.
"""
from __future__ import annotations

import ctypes

CUDA_SUCCESS, CUDA_ERROR_NO_DEVICE = 0, 100


def driver_count(lib: str = "libcuda.so.1") -> int | None:
    """GPUs the CUDA driver shows this process (0 when it has none), or None when there is no driver to ask
    or it answers with another error (then torch should be asked)."""
    try:
        cuda = ctypes.CDLL(lib)
    except OSError:
        return None
    if (err := cuda.cuInit(0)) != CUDA_SUCCESS:
        return 0 if err == CUDA_ERROR_NO_DEVICE else None
    count = ctypes.c_int(0)
    return count.value if cuda.cuDeviceGetCount(ctypes.byref(count)) == CUDA_SUCCESS else None


def visible() -> int:
    """GPUs this process would use: the driver's count, else torch's (which imports torch)."""
    count = driver_count()
    if count is not None:
        return count
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
