"""Large CPU tensors without page faults: keep glibc's freed memory for reuse.

glibc serves every allocation above 32 MiB with a fresh ``mmap`` and unmaps it on free, so each large
activation of every training step is paid again in page faults (the kernel zeroes each 4 KiB page on first
touch). On the 2-core benchmark VM that made a 50 MB ReLU take 23 ms instead of 3 ms, and one batched
FedAvg-CNN step 0.82 s instead of 0.41 s. :func:`tune_cpu_allocator` sets ``M_MMAP_MAX = 0`` (all
allocations from the heap) and a 1 GiB ``M_TRIM_THRESHOLD`` (freed memory stays mapped for reuse). It changes
the whole process's allocator, so it is opt-in: ``fedfast run`` and the benchmarks call it; library users
call it themselves (or set ``SimConfig(tune_cpu_allocator=True)``). The cost: freed heap memory is kept
(up to the trim threshold) instead of being returned to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_DONE = False


def tune_cpu_allocator(trim_threshold: int = 1 << 30) -> bool:
    """Apply the glibc settings above once per process. Returns True if they are in effect (False where the
    C library is not glibc, e.g. macOS/musl: nothing is changed)."""
    global _DONE
    if _DONE:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    _DONE = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, int(trim_threshold)))
    return _DONE
