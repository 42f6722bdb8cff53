"""Fitting a run to its device: probing the model on two samples, choosing the batched executor, sizing the
chunk of clients trained together, and naming the bytes and the setting to change when memory runs out."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..local_step import OPTIMIZERS, SAMGradient
from . import budget
from .memory import OutOfMemory, _free_bytes, _gib, _is_oom, fp32_semantics


class Sizing:
    """Mixin of :class:`fedfast.Simulation`: the model probe, the executor and the memory budget."""

    # -- set-up ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _probe_model(self):
        """One training sample through the model: it must run on the images and output num_classes logits."""
        x, _ = self.train.batch(torch.arange(min(2, len(self.train)), device=self.device))  # 2: BatchNorm1d
        try:
            out = self.model(x)
        except (RuntimeError, IndexError) as e:
            raise ValueError(f"model: cannot run on the training data (shape {tuple(x.shape[1:])}): {e}") from None
        C = self.train.num_classes
        if not (torch.is_tensor(out) and out.dim() == 2 and out.shape[1] == C):
            shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ValueError(f"model: must return logits [batch, {C}] for the {C} classes, got {shape}")

    @torch.no_grad()
    def _batched_plan(self):
        """The vmap-free executor for the model: the traced program of :mod:`fedfast.batched` where the model is a
        graph of its layers, else the grouped copy of :mod:`fedfast.grouped` (transformers), each checked against
        the model's own forward on a probe batch of two clients with different weights; None (vmap, with one
        warning saying why and what it costs) when neither can be used."""
        import warnings

        from .. import batched, grouped
        if self.cfg.executor == "vmap":
            return None
        whys = []
        for kind, make in (("traced program", batched.plan), ("grouped copy", grouped.plan)):
            prog, why = make(self.model)
            if isinstance(prog, batched.Plan):
                prog.conv = self.conv
            if prog is not None:
                why = self._probe_executor(prog, kind)
            if not why:
                return prog
            whys.append(why)
        warnings.warn(f"model: runs through torch.func.vmap(functional_call), not fedfast's batched executors, "
                      f"because {whys[0]}, and {whys[1]}; that path measured 1.7x slower per round on a 2-core CPU "
                      f"(FedAvg, simple_cnn, 1000 clients x 60, 50 per round). Supported layers: fedfast.batched, "
                      f"fedfast.grouped.", RuntimeWarning, stacklevel=3)
        return None

    def _probe_executor(self, prog, kind: str) -> str:
        """"" if ``prog`` reproduces ``functional_call`` of the model for two clients (the model's weights and a
        perturbed copy) on a probe batch of up to 4 training rows, else why not."""
        from torch.func import functional_call
        x, _ = self.train.batch(torch.arange(min(4, len(self.train)), device=self.device))
        gen = torch.Generator(device="cpu").manual_seed(0)
        pv = {}
        for k, v in self.model.named_parameters():
            noise = torch.randn(v.shape, generator=gen).to(v.device, v.dtype)
            pv[k] = torch.stack([v.detach(), v.detach() + 0.05 * v.detach().abs().mean() * noise])
        with self.eval_mode(), fp32_semantics():  # TF32 (cuDNN's default) would differ by ~1e-3 on both sides
            try:
                ref = torch.stack([functional_call(self.model, {k: v[i] for k, v in pv.items()}, (x,)).float()
                                   for i in range(2)])
                got = prog.forward(pv, torch.stack([x, x]), False).float()
            except (RuntimeError, ValueError, TypeError) as e:
                return f"its {kind} does not run ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        if not err <= 1e-4:
            return f"its {kind} differs from the model's forward (relative error {err:.1e})"
        return ""

    def _auto_chunk(self, P: int) -> int:
        """Clients per chunk (:func:`fedfast.sim.budget.chunk_clients`): parameter-sized rows plus activations must
        fit the budget (default 80 % of free GPU memory, 60 % of the CPU's MemAvailable). On a CPU also at most
        ``CPU_CHUNK_PARAM_BYTES`` of the chunk's parameters: per client-sample larger chunks are slower there
        (2-core VM, FedAvg CNN, 200 clients x 50, batch 10, bench_engine ``test_cpu_chunk_size``: chunks of 10-25
        clients 965-1021 samples/s, of 100-200 clients 488-644), while a GPU needs them."""
        c = self.cfg
        free = 0 if c.memory_budget_gb else _free_bytes(self.device)
        rows, act = self._client_bytes(P)
        return budget.chunk_clients(budget.budget_bytes(c.memory_budget_gb, self.device.type, free), rows, act, P,
                                    self.device.type)

    def _client_bytes(self, P: int) -> tuple[int, int]:
        """Bytes one client of a chunk needs (:func:`fedfast.sim.budget.client_bytes`): its parameter-sized fp32
        rows, and its activations measured here on two probe samples."""
        if self._client_bytes_cache is not None:
            return self._client_bytes_cache
        c = self.cfg
        state = self.method.client_state
        rows = budget.param_rows(OPTIMIZERS[c.client_optimizer].rows(c), state.data.shape[1] if state is not None
                                 else None, P, SAMGradient.rows if self.method.sam else 0)
        acts = []

        def hook(m, inp, o):
            acts.append(o.numel() if torch.is_tensor(o) else 0)
            if self.conv == "gemm" and isinstance(m, nn.Conv2d) and m.groups == 1:  # im2col: kept and its gradient
                acts.append(2 * inp[0].numel() * m.kernel_size[0] * m.kernel_size[1] // 3)
        hooks = [m.register_forward_hook(hook) for m in self.model.modules() if not list(m.children())]
        try:
            with torch.no_grad():
                self.model(self.train.batch(torch.arange(2, device=self.device) % len(self.train))[0])
        finally:
            for h in hooks:
                h.remove()
        self._client_bytes_cache = budget.client_bytes(P, rows, sum(acts), c.batch_size)
        return self._client_bytes_cache

    @contextlib.contextmanager
    def _memory(self, what: str, key: str):
        """Turn a device allocation failure inside the block into :class:`OutOfMemory` saying what needs how much
        and which setting (``key``) to change."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - only allocation failures are translated
            if not _is_oom(e):
                raise
            raise OutOfMemory(self._oom_message(what, key)) from None

    def _memory_state(self) -> str:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return f"{_gib(free)} free of {_gib(total)} on {self.device}"
        return f"{_gib(_free_bytes(self.device))} available on the CPU"

    def _oom_message(self, what: str, key: str) -> str:
        rows, act = self._client_bytes(self.num_params)
        return budget.oom_message(what, key, next_round=self.rnd + 1, memory_state=self._memory_state(),
                                  chunk=self.chunk, num_params=self.num_params, row_bytes=rows, act_bytes=act,
                                  batch_size=self.cfg.batch_size, eval_batch=self.eval_batch)
