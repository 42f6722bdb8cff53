"""One round's record as a method reads it (:class:`Round`), what a chunk's ``collect`` returns (:class:`Collected`),
and the round's accumulators, which the engine owns (:class:`RoundSums`).

The engine's plan builds a :class:`Round` complete - the sampled clients, their sizes, steps, weights, label
histograms and gathered state rows - and nothing writes it after: the engine attaches the round's
:class:`RoundSums` and each chunk's state by making new records (:meth:`Round.with_sums`, :meth:`Round.with_chunk`).
A method's hooks return what they compute (``round_start`` the round's sums, ``chunk_start`` / ``chunk_end`` the
chunk's state, ``collect`` a :class:`Collected`); the engine adds it into the :class:`RoundSums` (``fedfast/sim/
collect.py``), sums that across ranks, replaces a private run's released sums with their noised values, and the server
rule reads them through the record (``ctx.increment``, ``ctx.sums``)."""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from .._deprecation import deprecated

# the fields a method of the old guide wrote (a DeprecationWarning for one release), and the form that replaces each
_LEGACY = {
    "rows": "read ctx.rows; nothing writes it but the engine",
    "new_rows": "return fedfast.methods.Collected(rows=...) from collect",
    "incr": "return fedfast.methods.Collected(increment=...) from collect; the server reads ctx.increment",
    "reduce": "return the round's sums from round_start ({name: zeros}) and Collected(sums={name: ...}) "
    "from collect; the server reads ctx.sums[name]",
    "chunk": "return the chunk's state from chunk_start (or a new one from chunk_end)",
}


def _deprecated(name: str) -> None:
    deprecated(f"Round.{name} is deprecated for methods (it goes in the next release): {_LEGACY[name]}", 3)


@dataclass(eq=False, kw_only=True)
class RoundSums:
    """The round's accumulators, owned by the engine (a method reads them through its :class:`Round`):
    ``increment`` [P] (the chunks' :attr:`Collected.increment` summed, then over the ranks: the server's
    ``ctx.increment``), ``sums`` (the round's sums ``round_start`` declared, each chunk's :attr:`Collected.sums` added:
    ``ctx.sums``), ``state_out`` [m, cols] (the clients' new per-client state rows, which the engine stores after the
    round; None without per-client state). A private run's released sums replace the plain ones before ``server``."""

    increment: Tensor
    sums: dict = field(default_factory=dict)
    state_out: Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class Round:
    """One round's data in stack order (this rank's clients under torch.distributed), built complete by the engine's
    plan and never written after (a new chunk's state or the round's sums come as new records). A method reads it
    and returns what its hooks compute - ``round_start`` the round's sums, ``chunk_start`` / ``chunk_end`` the
    chunk's state, ``collect`` a :class:`Collected`. Setting an attribute raises AttributeError naming the new form
    (the old guide's ``new_rows``, ``incr``, ``reduce``, ``rows`` and ``chunk`` warn instead, for one release)."""

    index: int  # 0-based round number
    sampled: np.ndarray  # client ids
    sizes: np.ndarray  # local data sizes
    steps: np.ndarray  # local steps per epoch (``local_steps`` runs: those steps, in one "epoch")
    epochs: int  # local epochs (1 in ``local_steps`` runs); steps * epochs: each client's steps
    lr: float  # this round's client learning rate
    sampled_t: Tensor  # client ids on the device
    hist: Tensor  # [m, C] label histograms (ASD prior, FedADC+ confidence, FedLC)
    positions: Tensor | None = None  # [m] each client's position in the whole round's sorted client list
    num_total: int = 0  # clients in the whole round (all ranks)
    rows: Tensor | None = None  # [m, P] the method's per-client state rows (gathered from client_state)
    chunk: object = None  # the method's own per-chunk state: what its chunk_start returned (e.g. a dataclass)
    weights: np.ndarray | None = None  # [m] this rank's clients' aggregation weights (host)
    clients: np.ndarray | None = None  # the whole round's clients (all ranks) in stack order; row p of a
    #                                    per-client sum table is the client at position p (``positions``)
    data_batches: np.ndarray | None = None  # minibatches in one pass over each client's data (ceil(size / B))
    seen_hist: Tensor | None = None  # [m, C] labels of the rows each client trains on this round (epochs x hist)
    accumulators: RoundSums | None = field(default=None, repr=False)  # the engine's (read: increment, sums)

    @property
    def increment(self) -> Tensor | None:
        """[P] the collected increments, summed over the chunks and ranks (what ``server`` reads)."""
        return None if self.accumulators is None else self.accumulators.increment

    @property
    def sums(self):
        """The round's sums (``round_start`` declares them, ``collect`` adds to them), summed over the chunks and
        across ranks before ``server`` reads them: a read-only mapping of name -> tensor."""
        return types.MappingProxyType({} if self.accumulators is None else self.accumulators.sums)

    @property
    def state_out(self) -> Tensor | None:
        """The engine's: the collected new rows of the round's clients, stored after the round."""
        return None if self.accumulators is None else self.accumulators.state_out

    def with_sums(self, sums: RoundSums) -> Round:
        """This round's record with the engine's accumulators (a new record)."""
        return dataclasses.replace(self, accumulators=sums)

    def with_chunk(self, chunk) -> Round:
        """This round's record with a chunk's state (a new record; the hooks of that chunk read it as ``chunk``)."""
        return dataclasses.replace(self, chunk=chunk)

    @property
    def new_rows(self) -> Tensor | None:
        """Deprecated: the round's new state rows; ``collect`` returns ``Collected(rows=...)`` instead."""
        _deprecated("new_rows")
        return self.state_out

    @property
    def incr(self) -> Tensor | None:
        """Deprecated: ``ctx.increment`` (read), ``Collected(increment=...)`` (write)."""
        _deprecated("incr")
        return self.increment

    @property
    def reduce(self) -> dict:
        """Deprecated: ``ctx.sums`` (read), the round's sums from ``round_start`` and ``Collected(sums=...)``."""
        _deprecated("reduce")
        return self.accumulators.sums


def _legacy_setattr(self: Round, name: str, value) -> None:
    """A Round is frozen; the old guide's writes land where the engine now keeps them, warned, for one release."""
    if name not in _LEGACY:
        raise dataclasses.FrozenInstanceError(
            f"Round.{name}: a Round is read-only for methods; a hook returns what it computes (round_start: the "
            f"round's sums; chunk_start / chunk_end: the chunk's state; collect: "
            f"fedfast.methods.Collected(rows=, increment=, sums=))"
        )
    acc = self.accumulators
    if name == "incr" and acc is not None and value is acc.increment:  # ``ctx.incr += x`` added in place
        return
    _deprecated(name)
    if name in ("rows", "chunk"):
        object.__setattr__(self, name, value)
    else:
        setattr(acc, {"new_rows": "state_out", "incr": "increment", "reduce": "sums"}[name], value)


Round.__setattr__ = _legacy_setattr  # after @dataclass(frozen=True), which refuses a __setattr__ of the class's own


@dataclass(frozen=True)
class Collected:
    """What ``collect`` computed for the chunk's clients ``lo:hi`` (every field optional); the engine accumulates it.
    ``rows`` [hi-lo, cols]: the clients' new per-client state rows (the engine stores them after the round);
    ``increment`` [P]: added to the round's increment (``ctx.increment`` in ``server``, summed over the chunks and
    ranks); ``sums``: ``{name: tensor}`` added to the round's sums that ``round_start`` declared (``ctx.sums`` in
    ``server``)."""

    rows: Tensor | None = None
    increment: Tensor | None = None
    sums: dict | None = None
