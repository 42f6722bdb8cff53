"""What a method's round hooks return, accumulated by the engine (issue 50: hooks return what they compute; the
engine owns the accumulation; :class:`fedfast.methods.Round` is read-only for methods): the round's sums that
``round_start`` declares, and the :class:`fedfast.methods.Collected` of each chunk's ``collect`` - the clients' new
per-client state rows, an increment of the server's state, additions to the round's sums - checked, each error
naming the hook."""

from __future__ import annotations

import torch

from ..methods.base import Collected, Method, Round
from ..methods.hooks import HookError, describe_value, hook_site
from ..store.state import ClientState


def declare_sums(method: Method, ctx: Round) -> None:
    """``method.round_start(ctx)``; the sums it returns (name -> zero tensor) become the round's ``ctx.sums``."""
    got = method.round_start(ctx)
    if got is None:
        return
    if not (isinstance(got, dict) and all(isinstance(k, str) and k and torch.is_tensor(v) for k, v in got.items())):
        raise HookError(
            f"{hook_site(method, 'round_start')}: must return the round's sums, a dict of name -> zero "
            f"tensor of its shape (or None), got {describe_value(got)}"
        )
    twice = sorted(set(got) & set(ctx.sums))
    if twice:
        raise HookError(f"{hook_site(method, 'round_start')}: the sums {twice} are declared twice")
    ctx.sums.update(got)


def start_round(ctx: Round, state: ClientState | None, increment: torch.Tensor, device: torch.device) -> None:
    """The round's accumulators: the method's state rows gathered (``state``: its store, or None) with a buffer for
    their new values, and the zero increment."""
    if state is not None:
        ctx._set(rows=state.gather(ctx.sampled), state_out=torch.empty(len(ctx.sampled), state.cols, device=device))
    ctx._set(increment=increment)


def take(method: Method, ctx: Round, got: Collected | None, lo: int, hi: int) -> None:
    """A chunk's :class:`Collected` into the round's accumulators."""
    if got is None:
        return
    where = hook_site(method, "collect")
    if not isinstance(got, Collected):
        raise HookError(f"{where}: must return a fedfast.methods.Collected (or None), got {describe_value(got)}")
    if got.rows is not None:
        if ctx.state_out is None:
            raise HookError(
                f"{where}: returned state rows, but the method declares no per-client state (client_state_spec)"
            )
        want = (hi - lo, ctx.state_out.shape[1])
        if not (torch.is_tensor(got.rows) and tuple(got.rows.shape) == want):
            raise HookError(
                f"{where}: Collected.rows must be the chunk's clients' new rows, a tensor {want}, got "
                f"{describe_value(got.rows)}"
            )
        ctx.state_out[lo:hi] = got.rows
    if got.increment is not None:
        if not (torch.is_tensor(got.increment) and got.increment.shape == ctx.increment.shape):
            raise HookError(
                f"{where}: Collected.increment must be a tensor {tuple(ctx.increment.shape)}, got "
                f"{describe_value(got.increment)}"
            )
        ctx.increment.add_(got.increment)
    for k, v in (got.sums or {}).items():
        if k not in ctx.sums:
            raise HookError(
                f"{where}: Collected.sums[{k!r}]: not one of the round's sums that round_start declared "
                f"({sorted(ctx.sums)})"
            )
        if not (torch.is_tensor(v) and v.shape == ctx.sums[k].shape):
            raise HookError(
                f"{where}: Collected.sums[{k!r}] must be a tensor {tuple(ctx.sums[k].shape)}, got {describe_value(v)}"
            )
        ctx.sums[k] += v


def release(ctx: Round, released: dict) -> None:
    """A private run's noised upload sums (``{target: tensor}``, :meth:`fedfast.privacy.Mechanism.released`) in
    place of the plain ones the chunks accumulated: ``"increment"`` is ``ctx.increment``, any other target the round
    sum of its name."""
    for k, v in released.items():
        if k == "increment":
            ctx._set(increment=v)
        else:
            ctx.sums[k] = v
