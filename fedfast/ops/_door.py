"""One door per fused op (issue 61): an op's arguments as one record, and one backend table.

* The **argument record** (an :class:`OpArgs` dataclass) is the Python twin of the op's ``FEDFAST_<OP>`` signature in
  ``csrc/op_signatures.h``: the same parameters in the same order, named as there without the C++ side's ``_in`` /
  ``_opt`` suffixes (``tests/test_op_door.py`` reads the header and compares). The entry point builds it once, after
  its checks; every compiled backend (C++ CPU, CUDA, Triton) takes its fields in that order (:meth:`OpArgs.values`),
  and the reference reads them by name.
* The **backend table** (:class:`Backends`) maps each backend name to the one function that runs the op there,
  taking the record: the entry point is its validation, the record, :func:`fedfast.ops._backend.resolve` and one
  table call, with no backend if-chain of its own. What a backend needs beyond the common order (a concatenated
  gradient, a pass after the kernel) is that backend's entry, beside the others in the op's file.

A new op: its macro in ``op_signatures.h``, its record here-like in its file (``SIGNATURE`` names the macro), a
table with an entry per backend (:func:`extension` for a compiled function that takes the record's fields as they
are), and its reference.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

from . import _backend


@dataclasses.dataclass(frozen=True)
class OpArgs:
    """Base of an op's argument record (a frozen dataclass whose fields are the op's C++ parameters, in order)."""

    SIGNATURE: ClassVar[str] = ""  # the macro in csrc/op_signatures.h, e.g. "FEDFAST_CLIENT_STEP"

    def values(self) -> tuple:
        """The fields in the signature's order (no copies: the tensors themselves)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def replace(self, **changes) -> OpArgs:
        """The record with ``changes`` (a backend's own reading of a field)."""
        return dataclasses.replace(self, **changes)


def extension(kind: str, name: str) -> Callable:
    """A compiled extension's function ``name`` (``kind``: ``"cpu"`` for ``fedfast._C``, ``"cuda"`` for
    ``fedfast._C_cuda``) as a table entry: called with the record's fields in order."""
    load = _backend.cpu_ext if kind == "cpu" else _backend.cuda_ext

    def run(args: OpArgs, **_):
        return getattr(load(), name)(*args.values())

    run.__qualname__ = run.__name__ = f"{kind}:{name}"
    return run


class Backends:
    """One op's backend table: ``Backends("client_step", reference=f, cpu=g, ...)``; ``table(backend, args)`` runs
    the op on ``backend`` (a name :func:`fedfast.ops._backend.resolve` returned)."""

    def __init__(self, op: str, **impls: Callable):
        unknown = sorted(set(impls) - set(_backend.BACKENDS))
        if unknown or "reference" not in impls:
            raise ValueError(f"{op}: a table names backends among {_backend.BACKENDS}, the reference included")
        self.op, self.impls = op, impls

    def __call__(self, backend: str, args: OpArgs, **options):
        """The op on ``backend``; ``options``: what only some backends read (passed to the entry as keywords)."""
        fn = self.impls.get(backend)
        if fn is None:
            raise ValueError(f"backend: {self.op} has no {backend!r} backend (it has {', '.join(self.impls)})")
        return fn(args, **options)

    def __repr__(self) -> str:
        return f"Backends({self.op!r}: {', '.join(self.impls)})"
