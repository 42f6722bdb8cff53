"""Fitting a run to its device: the bytes one client of a chunk needs (its parameter-sized buffers, its activations
measured on two probe samples), how many clients a chunk holds (with the per-client state a method declares), and the
:class:`~fedfast.sim.memory.OutOfMemory` that names the bytes and the setting to change. The arithmetic is
:mod:`fedfast.sim.budget`'s; this part measures its inputs."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .._settings import Settings
from ..local_step import OPTIMIZERS, OptimizerSettings, SAMGradient
from ..methods.base import Method
from . import budget
from .memory import OutOfMemory, _free_bytes, _gib, _is_oom
from .runtime import ModelRuntime


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetSettings(Settings):
    """What the memory budget reads of a run's config: the budget, the batch size and the client optimiser (its
    rows per client). The per-client state's own settings are the stores' (:class:`fedfast.sim.stores.StoreSettings`):
    the budget sizes the chunk with the state a method declares, and does not build the store."""

    memory_budget_gb: float | None
    batch_size: int
    optimizer: OptimizerSettings


class MemoryBudget:
    """The memory budget of a run of ``method`` with the model ``runtime`` runs (:class:`ModelRuntime`) on
    ``device``."""

    def __init__(
        self,
        settings: BudgetSettings,
        method: Method,
        runtime: ModelRuntime,
        device: torch.device,
    ):
        self.settings = BudgetSettings.given(settings)
        self.method, self.runtime, self.device = method, runtime, device
        self.state_values = None  # values per client of the method's per-client state (its declaration)
        self._client_bytes = None

    def declare(self, values: int | None) -> None:
        """The method's per-client state, ``values`` per client (None: none): the chunk is sized with it."""
        self.state_values, self._client_bytes = values, None

    def client_bytes(self) -> tuple[int, int]:
        """(parameter-row bytes, activation bytes) of one client (:func:`fedfast.sim.budget.client_bytes`),
        measured once (with the method's declared per-client state, :meth:`declare`)."""
        if self._client_bytes is None:
            c, P = self.settings, self.runtime.num_params
            rows = budget.param_rows(
                OPTIMIZERS[c.optimizer.client_optimizer].rows(c.optimizer),
                self.state_values,
                P,
                SAMGradient.rows if self.method.sam else 0,
            )
            act = self.runtime.activation_elems(with_im2col=self.runtime.conv == "gemm")
            self._client_bytes = budget.client_bytes(P, rows, act, c.batch_size)
        return self._client_bytes

    def auto_chunk(self) -> int:
        """Clients per chunk (:func:`fedfast.sim.budget.chunk_clients`): parameter-sized rows plus activations must
        fit the budget (default 80 % of free GPU memory, 60 % of the CPU's MemAvailable). On a CPU also at most
        ``CPU_CHUNK_PARAM_BYTES`` of the chunk's parameters: per client-sample larger chunks are slower there
        (2-core VM, FedAvg CNN, 200 clients x 50, batch 10, bench_engine ``test_cpu_chunk_size``: chunks of 10-25
        clients 965-1021 samples/s, of 100-200 clients 488-644), while a GPU needs them."""
        c, P = self.settings, self.runtime.num_params
        free = 0 if c.memory_budget_gb else _free_bytes(self.device)
        rows, act = self.client_bytes()
        return budget.chunk_clients(
            budget.budget_bytes(c.memory_budget_gb, self.device.type, free), rows, act, P, self.device.type
        )

    def memory_state(self) -> str:
        """What is free on the device, in words."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return f"{_gib(free)} free of {_gib(total)} on {self.device}"
        return f"{_gib(_free_bytes(self.device))} available on the CPU"

    def oom_message(self, what: str, key: str, *, next_round: int, chunk: int) -> str:
        """The message of an :class:`OutOfMemory` in ``what`` (:func:`fedfast.sim.budget.oom_message`)."""
        rows, act = self.client_bytes()
        return budget.oom_message(
            what,
            key,
            next_round=next_round,
            memory_state=self.memory_state(),
            chunk=chunk,
            num_params=self.runtime.num_params,
            row_bytes=rows,
            act_bytes=act,
            batch_size=self.settings.batch_size,
            eval_batch=self.runtime.eval_batch,
        )

    @contextlib.contextmanager
    def guard(self, what: str, key: str, *, next_round: int, chunk: int):
        """Turn a device allocation failure inside the block into :class:`OutOfMemory` saying what needs how much
        and which setting (``key``) to change."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - only allocation failures are translated
            if not _is_oom(e):
                raise
            raise OutOfMemory(self.oom_message(what, key, next_round=next_round, chunk=chunk)) from None
