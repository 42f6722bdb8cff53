"""A chunk's local training: every local step of the chunk's clients at once - the minibatch tables in each
client's seeded data order, the batched forward and the method's (or a user's) loss, the gradient (plain or SAM's)
and the client optimiser's fused step with the method's terms."""
from __future__ import annotations

import numpy as np
import torch

from .._io import host_to_device
from ..local_step import PlainGradient, SAMGradient
from ..methods.base import Round, Step


class LocalTraining:
    """Mixin of :class:`fedfast.Simulation`: phase 3 for one chunk of clients."""

    def _train_chunk(self, ctx: Round, lo: int, hi: int, teacher, loss_sum):
        """Local training of the round's clients ``lo:hi`` (stack order) in stack rows ``0:hi-lo``."""
        c, method = self.cfg, self.method
        steps = ctx.steps
        n, B, S = hi - lo, c.batch_size, int(steps[lo])
        theta_all = self.stack.params
        self.stack.broadcast_(self.global_flat, rows=slice(0, n))
        self.optimizer.reset(n)
        step_kw = dict(lr=ctx.lr, weight_decay=c.weight_decay, max_norm=c.max_grad_norm or None, backend=c.backend)
        ctx.chunk = None
        ctx.chunk = method.chunk_start(ctx, lo, hi)  # the method's own per-chunk state, handed back as ctx.chunk
        hist_c = ctx.hist[lo:hi]
        features = self._features_module() if method.needs_features else None
        rho = float(method.sam_rho(ctx))
        if not rho >= 0:
            raise ValueError(f"{method.name}.sam_rho: the SAM radius must be >= 0, got {rho}")
        if rho and not method.sam:
            raise ValueError(f"{method.name}.sam_rho: {rho:g} > 0, but the method does not declare sam = True (the "
                             f"memory budget counts SAM's two extra parameter rows per client only then)")
        if rho and self._sam is None:
            self._sam = SAMGradient(self.stack.params)
        rule = self._sam if rho else PlainGradient()
        if rho:
            rule.rho = rho
        for e in range(ctx.epochs):
            rows = self._step_rows[lo:hi] if self._step_rows is not None else self._batch_table(ctx, lo, hi, e, S * B)
            table = host_to_device(rows, self.device)
            for s in range(S):
                n_act = int((steps[lo:hi] > s).sum())
                x, y, valid, ridx = self._minibatch(ctx, table, lo, n_act, e, s)
                self._tick("data")
                pv = self.stack.leaf_views(slice(0, n_act))  # autograd leaves sharing the stack's storage
                t = teacher.rows(ridx.reshape(-1), x) if teacher is not None else None
                self._tick("teacher")
                seg = torch.arange(n_act, device=self.device).repeat_interleave(B)
                batch = dict(x=x, y=y, valid=valid, seg=seg, teacher=t, hist=hist_c[:n_act], features=features,
                             epoch=e, step=s)
                loss = self._step_loss(ctx, pv, perturbed=False, **batch)
                grad = rule.gradient(  # plain, or SAM's (the gradient at w + rho g / ||g||, applied at w)
                    self.stack, loss, pv, n_act,
                    lambda p2: self._step_loss(ctx, p2, perturbed=True, **batch),
                    None if self.gradbuf is None else self.gradbuf[:n_act])
                self._tick("backward")
                terms = method.step_terms(ctx, n_act)
                if not isinstance(terms, dict):
                    from ..methods.hooks import check_hook_return
                    check_hook_return(method, "step_terms", terms, kind="dict",
                                      what="a dict of fedfast.ops.client_step keyword arguments ({} for none)")
                self.optimizer.step(theta_all, grad, n_act, {**step_kw, **terms})
                loss_sum += loss.detach()  # sum of the active clients' minibatch means (no host sync)
                self._tick("step")
        method.chunk_end(ctx, lo, hi)

    def _minibatch(self, ctx: Round, table: torch.Tensor, lo: int, n_act: int, e: int, s: int):
        """Step ``s`` of epoch ``e``: the active clients' inputs [n_act, B, ...] (augmented with random parameters
        keyed by (round, epoch, step, client position): the same for any chunking or number of processes), labels
        (-100 on padding rows), the valid-row mask and the row indices."""
        c, B = self.cfg, self.cfg.batch_size
        rows = table[:n_act, s * B:(s + 1) * B]
        valid = rows >= 0
        ridx = rows.clamp_min(0)
        if c.augment != "none":
            from ..data.augment import augmented_batch
            self._aug_gen.manual_seed(int(np.random.SeedSequence([c.seed, 104729, self.rnd, e, s])
                                          .generate_state(1, np.uint64)[0]) & (2**63 - 1))
            pos = (ctx.positions[lo:lo + n_act, None] * B + self._arange_b[None, :B]).reshape(-1)
            x, y = augmented_batch(self.train, ridx, self._aug_gen, pipeline=c.augment, select=(ctx.num_total * B, pos))
        else:
            x, y = self.train.batch(ridx)
        return x, torch.where(valid, y, torch.full_like(y, -100)), valid, ridx

    def _step_loss(self, ctx: Round, pv, *, x, y, valid, seg, teacher, hist, features, perturbed: bool, epoch: int,
                   step: int):
        """The forward of the active clients with parameters ``pv`` and the method's (or ``loss_fn``'s) loss."""
        n_act = x.shape[0]
        out = self.stack.vmap_forward(x, rows=slice(0, n_act), params=pv, features=features)
        feat, z = out if features is not None else (None, out)
        self._tick("forward")
        zf, yf = z.reshape(-1, z.shape[-1]), y.reshape(-1)
        if self.loss_fn is not None:
            loss = self.loss_fn(zf, teacher.logits if teacher is not None else None, yf, seg, n_act)
        else:
            loss = self.method.loss(ctx, Step(logits=zf, target=yf, segments=seg, num_clients=n_act, teacher=teacher,
                                              hist=hist, x=x, valid=valid, features=feat, params=pv,
                                              perturbed=perturbed, epoch=epoch, step=step))
        if not (torch.is_tensor(loss) and loss.dim() == 0 and loss.is_floating_point() and loss.requires_grad):
            self._bad_loss(loss)
        self._tick("loss")
        return loss

    def _bad_loss(self, loss) -> None:
        """HookError naming the loss hook (or loss_fn), its file and line, what it must return and what it gave."""
        import inspect

        from ..methods.hooks import HookError, describe_value, hook_site
        if self.loss_fn is not None:
            fn = inspect.unwrap(getattr(self.loss_fn, "__call__", self.loss_fn) if not inspect.isfunction(self.loss_fn)
                                else self.loss_fn)
            code = getattr(fn, "__code__", None)
            where = f"loss_fn ({code.co_filename}, line {code.co_firstlineno})" if code else "loss_fn"
        else:
            where = hook_site(self.method, "loss")
        must = ("one number: a 0-d float tensor that depends on the logits (the sum over the active clients of "
                "each client's minibatch mean; fedfast.methods.weighted_mean_rows(rows, b.valid) makes it from "
                "per-row losses)")
        if torch.is_tensor(loss) and loss.dim() == 0 and loss.is_floating_point():
            raise HookError(f"{where}: must return {must}; the returned value has no gradient (computed without "
                            f"autograd, detached, or from no input that requires grad)")
        raise HookError(f"{where}: must return {must}, got {describe_value(loss)}")

    def _batch_table(self, ctx: Round, lo: int, hi: int, epoch: int, width: int) -> np.ndarray:
        """Host index math (numpy, once per epoch): each client's own data order, padded with -1."""
        table = np.full((hi - lo, width), -1, dtype=np.int64)
        for j in range(hi - lo):
            k, nk = int(ctx.sampled[lo + j]), int(ctx.sizes[lo + j])
            perm = self._order(k, epoch, nk)
            take = min(nk if not self.cfg.drop_last else (nk // self.cfg.batch_size) * self.cfg.batch_size, width)
            table[j, :take] = self._idx_host[k][perm[:take]]
        return table
