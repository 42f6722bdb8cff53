"""The secret a private run's randomness comes from: its noise and, where the analysis assumes them secret, its
cohorts.

A :class:`Secret` is 128 bits from the operating system's entropy source (:func:`secrets.randbits`), never derived
from the run seed (which config.json, summary.json and the checkpoint all show: noise drawn from it could be
regenerated and subtracted by anyone holding the run directory). Each release's randomness is a stream of its own,
keyed by ``(secret, stream, index)`` through numpy's ``SeedSequence``: round ``r``'s noise is the same however
the run was stopped and resumed, so the secret alone is the generator state a checkpoint saves for an exact resume.
The checkpoint is therefore secret too (docs/privacy.md, the threat model).
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

NOISE = 1  # a round's Gaussian noise (DP-FedAvg) or a tree node's (DP-FTRL)
COHORT = 2  # the cohort sampling (numpy's generators are keyed by the secret instead of the run seed)


class Secret:
    """``Secret()``: 128 fresh bits from the OS; ``Secret(key)``: a given one (a checkpoint's)."""

    def __init__(self, key: int | None = None):
        self.key = secrets.randbits(128) if key is None else self._checked(key)

    @staticmethod
    def _checked(key) -> int:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**128:
            raise ValueError("checkpoint: a private run's secret is a 128-bit integer; this one is damaged")
        return key

    def seed(self, stream: int, *index: int) -> int:
        """A 63-bit seed for ``(stream, *index)`` (torch generators take 64 bits; numpy takes the key itself)."""
        state = np.random.SeedSequence(self.key, spawn_key=(stream, *index)).generate_state(2, np.uint32)
        return (int(state[0]) | (int(state[1]) << 32)) & (2**63 - 1)

    def generator(self, device: torch.device | str, stream: int, *index: int) -> torch.Generator:
        """A torch generator on ``device`` for ``(stream, *index)``: the same draws each time it is made."""
        return torch.Generator(device=device).manual_seed(self.seed(stream, *index))

    def cohort_seed(self) -> int:
        """The 128-bit seed the cohort samplers (:mod:`fedfast.sampling`) take in place of the run seed."""
        words = np.random.SeedSequence(self.key, spawn_key=(COHORT,)).generate_state(4, np.uint32)
        return sum(int(w) << (32 * i) for i, w in enumerate(words))

    def shared(self, broadcast, device) -> "Secret":
        """This secret made every process's: ``broadcast(t)`` puts process 0's int64 tensor ``t`` into every
        process's (``torch.distributed``: every rank then draws the same noise and cohorts); returns ``self``."""
        t = torch.tensor([(self.key >> (32 * i)) & 0xFFFFFFFF for i in range(4)], dtype=torch.int64, device=device)
        broadcast(t)
        self.key = sum(int(w) << (32 * i) for i, w in enumerate(t.tolist()))
        return self

    def state_dict(self) -> dict:
        # as a hex string: a checkpoint holds plain data, and torch.save keeps Python ints of any size, but a
        # string survives every reader of the format
        return {"key": format(self.key, "032x")}

    def load_state_dict(self, st: dict) -> None:
        try:
            key = int(st["key"], 16)
        except (KeyError, TypeError, ValueError):
            raise ValueError("checkpoint: a private run's secret is missing or damaged") from None
        self.key = self._checked(key)
