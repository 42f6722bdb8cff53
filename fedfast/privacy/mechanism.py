"""The privacy mechanism's contract with the engine (pfl-research's split: a per-client bound step and a noise step
on the sum), and :class:`NoPrivacy`, the null object a run without ``dp_clip`` gets.

Each round the engine calls, in this order and without asking which mechanism it holds:

1. ``begin_round(ctx)``: the round's bound (the clip; None without one). A mechanism refuses here what its
   analysis does not cover (a method's round sums are uploads too);
2. per chunk of clients, ``upload_rows(method, ctx, lo, hi)``: the clients' declared uploads beside their updates
   (``Method.upload_rows``; None without), then ``bound(extra, weights, norms, uploads, clients, g)``: the keyword
   arguments of :func:`fedfast.ops.aggregate` that bound each client's contribution inside the aggregation's own
   pass (clipping factors as unnormalised weights, from the update norms of the clients' last local steps,
   ``norms``, joint with the uploads), with the method's own ``extra``; then ``chunk_sum(out, weights, g)``: what
   the chunk adds to the round's sum, from the op's result ``out``, and ``check_collected(got)`` on what the
   method's ``collect`` returned;
3. ``round_sums()``: the mechanism's own per-round sums (adaptive clipping's count), all-reduced across processes
   with the round's other sums;
4. ``average(g, total, total_weight, ctx)``: the noise step: the round's average from the (all-reduced) sum, or
   None when the round had no client and the global model stays; then ``released()``: the noised upload sums
   the server rule reads (``{target: tensor}``);
5. ``record(rec, rounds)``: what the round's record says of privacy (epsilon spent, the clip used), and
   ``publish(rec)``: the record as the run keeps and writes it (a private run leaves out what its accounting does
   not cover, docs/privacy.md);
6. ``checkpoint(rounds)`` / ``restore(ck, rounds)``: the mechanism's part of a checkpoint after ``rounds`` rounds,
   and its restore (``rounds``: the run's planned rounds), which refuses a checkpoint whose accounting settings
   differ from the run's (naming the key).

``needs_norms``: whether the clients' last local steps add up their update norms (``ops.client_step``'s
``delta_norm``) for the bound step.
"""

from __future__ import annotations

import torch


class Mechanism:
    """The contract (module docstring). ``private``: whether the run's releases are accounted."""

    name = "none"
    private = False
    needs_norms = False

    def begin_round(self, ctx):  # pragma: no cover - the contract
        raise NotImplementedError

    def upload_rows(self, method, ctx, lo: int, hi: int) -> dict | None:
        return None

    def bound(self, extra: dict, weights, norms, uploads=None, clients=None, g=None) -> dict:  # pragma: no cover
        raise NotImplementedError

    def chunk_sum(self, out: dict, weights: torch.Tensor, g: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def check_collected(self, got) -> None:
        pass

    def round_sums(self) -> list:
        return []

    def released(self) -> dict:
        return {}

    def average(self, g: torch.Tensor, total: torch.Tensor, total_weight: float, ctx):  # pragma: no cover
        raise NotImplementedError

    def record(self, rec: dict, rounds: int) -> None:
        pass

    def publish(self, rec: dict) -> dict:
        return rec

    def epsilon(self, rounds: int) -> float | None:
        return None

    def checkpoint(self, rounds: int) -> dict:
        return {}

    def restore(self, ck: dict, rounds: int) -> None:  # pragma: no cover - the contract
        raise NotImplementedError


class NoPrivacy(Mechanism):
    """A run without ``dp_clip``: the weighted average of the clients' models, nothing bounded, nothing noised."""

    def begin_round(self, ctx):
        return None

    def bound(self, extra: dict, weights, norms, uploads=None, clients=None, g=None) -> dict:
        return dict(weights=weights, **extra)

    def chunk_sum(self, out: dict, weights: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return weights.sum() * out["average"]

    def average(self, g: torch.Tensor, total: torch.Tensor, total_weight: float, ctx):
        return total / total_weight if total_weight > 0 else None  # no client (Poisson sampling): the model stays

    def restore(self, ck: dict, rounds: int) -> None:
        if "privacy" in ck:
            raise ValueError("checkpoint: a private run's (dp_clip), this config is not private")
