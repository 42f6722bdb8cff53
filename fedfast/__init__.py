"""fedfast: fused knowledge-distillation losses and kernels for federated learning simulation."""

from . import methods, nn, ops  # noqa: E402
from ._version import __version__  # noqa: E402
from .cpu_alloc import tune_cpu_allocator  # noqa: E402
from .engine import Simulation  # noqa: E402
from .sim.diverged import Diverged  # noqa: E402
from .sim.memory import OutOfMemory  # noqa: E402
from .simconfig import SimConfig  # noqa: E402

__all__ = [
    "methods",
    "nn",
    "ops",
    "SimConfig",
    "Simulation",
    "Diverged",
    "OutOfMemory",
    "tune_cpu_allocator",
    "__version__",
]
