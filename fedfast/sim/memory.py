"""Memory: what is free on a device, the error a run that does not fit raises, and full-fp32 matmuls."""

from __future__ import annotations

import contextlib

import torch


class OutOfMemory(MemoryError):
    """The run does not fit the device's memory. The message says how many bytes the failing allocation group
    needs, what is free, and which setting to change (``client_chunk``, ``memory_budget_gb``, ``eval_batch``,
    ``state_on_host``, ``state_dtype``)."""


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _is_oom(e: BaseException) -> bool:
    """A device allocation failure (CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError)."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


CPU_CHUNK_PARAM_BYTES = 128 * 2**20  # auto chunking on a CPU: at most this much of the chunk's parameters


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


@contextlib.contextmanager
def tf32_semantics(on: bool = True):
    """Matrix products and cuDNN convolutions with TF32 allowed (``on``) or in full fp32 inside the block, the
    flags restored after it."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = bool(on)
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def fp32_semantics():
    """Matrix products and cuDNN convolutions in full fp32 (no TF32) inside the block, restored after it."""
    return tf32_semantics(False)
