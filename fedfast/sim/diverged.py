"""A run that diverged: :class:`Diverged` (raised by :class:`fedfast.Simulation`) and the once-per-round check that
raises it (one host read of two flags per round; every rank sees the same values)."""

from __future__ import annotations

import math

import torch

from ..local_step import OptimizerSettings


class Diverged(ArithmeticError):
    """The run diverged: a non-finite training loss, client update, global model or test loss at round
    ``round``. ``record``: that round's metrics (None when a client update was refused before evaluation);
    ``optimizer``: the run's client-optimiser settings (or its SimConfig), which the message names."""

    def __init__(self, rnd: int, method: str, what: str, optimizer: OptimizerSettings, record: dict | None = None):
        self.round, self.method, self.what, self.record = rnd, method, what, record
        o = OptimizerSettings.of(optimizer)
        steps = (
            f"lr={o.lr:g}"
            + (f", momentum={o.momentum:g}" if o.momentum else "")
            + (f", {o.client_optimizer}" if o.client_optimizer != "sgd" else "")
            + (f", max_grad_norm={o.max_grad_norm:g}" if o.max_grad_norm else ", no gradient clipping")
        )
        hint = (
            ["a lower lr"]
            + (["lower momentum"] if o.momentum else [])
            + (["clipping (max_grad_norm = 10)"] if not o.max_grad_norm else [])
        )
        super().__init__(
            f"round {rnd}: {method} diverged ({what} is NaN or inf). Likely cause: local steps too "
            f"large for this model and data ({steps}); try {', '.join(hint[:-1])}"
            f"{' or ' if len(hint) > 1 else ''}{hint[-1]}"
        )


def check_finite(rec: dict, state, method: str, optimizer: OptimizerSettings, *, train_loss: float) -> None:
    """Divergence ends the run: a non-finite train loss (``train_loss``: the round's, which a private run's record
    leaves out), global (or evaluated) model or test loss raises :class:`Diverged`."""
    what = []
    if not math.isfinite(train_loss):
        what.append("the training loss")
    ok = torch.stack(
        [
            torch.isfinite(state.global_flat).all() & torch.isfinite(state.global_buffers).all(),
            torch.isfinite(state.eval_flat).all(),
        ]
    ).tolist()
    if not ok[0]:
        what.append("the global model")
    elif not ok[1]:
        what.append("the evaluated model")
    if rec["test_loss"] is not None and not math.isfinite(rec["test_loss"]):
        what.append("the test loss")
    if what:
        raise Diverged(rec["round"], method, " and ".join(what), optimizer, rec)
