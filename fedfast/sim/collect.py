"""What a method's round hooks return, accumulated by the engine (issue 50: hooks return what they compute; the
engine owns the accumulation, in the round's :class:`fedfast.methods.RoundSums`; the :class:`fedfast.methods.Round`
is never written): the round's sums that
``round_start`` declares, and the :class:`fedfast.methods.Collected` of each chunk's ``collect`` - the clients' new
per-client state rows, an increment of the server's state, additions to the round's sums - checked, each error
naming the hook."""

from __future__ import annotations

import torch

from ..methods.base import Method
from ..methods.hooks import HookError, describe_value, hook_site
from ..methods.round import Collected, Round, RoundSums
from ..store.state import ClientState


def open_round(method: Method, ctx: Round, state: ClientState | None, increment: torch.Tensor) -> Round:
    """The round's record with its accumulators (:class:`fedfast.methods.RoundSums`, the engine's): the zero
    ``increment``, a buffer for the method's new state rows (``state``: its store, or None), and the sums
    ``method.round_start(ctx)`` declares (name -> zero tensor, the round's ``ctx.sums``)."""
    out = None if state is None else torch.empty(len(ctx.sampled), state.cols, device=increment.device)
    ctx = ctx.with_sums(RoundSums(increment=increment, state_out=out))
    got = method.round_start(ctx)
    if got is None:
        return ctx
    if not (isinstance(got, dict) and all(isinstance(k, str) and k and torch.is_tensor(v) for k, v in got.items())):
        raise HookError(
            f"{hook_site(method, 'round_start')}: must return the round's sums, a dict of name -> zero "
            f"tensor of its shape (or None), got {describe_value(got)}"
        )
    twice = sorted(set(got) & set(ctx.sums))
    if twice:
        raise HookError(f"{hook_site(method, 'round_start')}: the sums {twice} are declared twice")
    ctx.accumulators.sums.update(got)
    return ctx


def take(method: Method, acc: RoundSums, got: Collected | None, lo: int, hi: int) -> None:
    """A chunk's :class:`Collected` into the round's accumulators ``acc``."""
    if got is None:
        return
    where = hook_site(method, "collect")
    if not isinstance(got, Collected):
        raise HookError(f"{where}: must return a fedfast.methods.Collected (or None), got {describe_value(got)}")
    if got.rows is not None:
        if acc.state_out is None:
            raise HookError(
                f"{where}: returned state rows, but the method declares no per-client state (client_state_spec)"
            )
        want = (hi - lo, acc.state_out.shape[1])
        if not (torch.is_tensor(got.rows) and tuple(got.rows.shape) == want):
            raise HookError(
                f"{where}: Collected.rows must be the chunk's clients' new rows, a tensor {want}, got "
                f"{describe_value(got.rows)}"
            )
        acc.state_out[lo:hi] = got.rows
    if got.increment is not None:
        if not (torch.is_tensor(got.increment) and got.increment.shape == acc.increment.shape):
            raise HookError(
                f"{where}: Collected.increment must be a tensor {tuple(acc.increment.shape)}, got "
                f"{describe_value(got.increment)}"
            )
        acc.increment.add_(got.increment)
    for k, v in (got.sums or {}).items():
        if k not in acc.sums:
            raise HookError(
                f"{where}: Collected.sums[{k!r}]: not one of the round's sums that round_start declared "
                f"({sorted(acc.sums)})"
            )
        if not (torch.is_tensor(v) and v.shape == acc.sums[k].shape):
            raise HookError(
                f"{where}: Collected.sums[{k!r}] must be a tensor {tuple(acc.sums[k].shape)}, got {describe_value(v)}"
            )
        acc.sums[k] += v


def release(acc: RoundSums, released: dict) -> None:
    """A private run's noised upload sums (``{target: tensor}``, :meth:`fedfast.privacy.Mechanism.released`) in
    place of the plain ones the chunks accumulated in ``acc``: ``"increment"`` the round's increment, any other
    target the round sum of its name."""
    for k, v in released.items():
        if k == "increment":
            acc.increment = v
        else:
            acc.sums[k] = v
