"""Fitting a run to its device: the bytes one client of a chunk needs (its parameter-sized buffers, its activations
measured on two probe samples), how many clients a chunk holds, the per-client state's allocation, and the
:class:`~fedfast.sim.memory.OutOfMemory` that names the bytes and the setting to change. The arithmetic is
:mod:`fedfast.sim.budget`'s; this part measures its inputs."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import torch

from .._settings import Settings
from ..local_step import OPTIMIZERS, OptimizerSettings, SAMGradient
from ..methods.base import Method
from ..store.state import ClientState
from . import budget
from .memory import OutOfMemory, _free_bytes, _gib, _is_oom
from .runtime import ModelRuntime


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetSettings(Settings):
    """What the memory budget reads of a run's config: the budget, the batch size, the client optimiser (its rows
    per client), and the per-client state's dtype, place and memory limit (``rounds``: how many clients' rows the
    store can come to hold)."""

    memory_budget_gb: float | None
    batch_size: int
    optimizer: OptimizerSettings
    state_dtype: str
    state_on_host: bool
    state_store: str
    state_memory_gb: float | None
    rounds: int


class MemoryBudget:
    """The memory budget of a run of ``method`` with the model ``runtime`` runs (:class:`ModelRuntime`) on
    ``device``."""

    def __init__(
        self,
        settings: BudgetSettings,
        method: Method,
        runtime: ModelRuntime,
        device: torch.device,
        state_dir: str | None = None,
        max_cohort: int = 1,
    ):
        self.settings = BudgetSettings.given(settings)
        self.method, self.runtime, self.device = method, runtime, device
        self.state_dir, self.max_cohort = state_dir, max_cohort
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

    def client_state(
        self,
        num_clients: int,
        fill: torch.Tensor | None = None,
        rows: int = 1,
        *,
        cols: int | None = None,
        name: str | None = None,
        float32: bool = False,
    ) -> ClientState:
        """Per-client state of ``num_clients`` clients, ``rows`` parameter-sized rows each (or ``cols`` values), in
        the settings' dtype and place (:class:`fedfast.store.ClientState`: rows held for the clients written only);
        ``fill``: a client's initial value, [P] (repeated ``rows`` times) or [rows * P] (``cols``: [cols]).
        ``name``: the store's (its file's) name, default the method's; ``float32``: whatever ``state_dtype`` says
        (the engine's own store of BatchNorm statistics)."""
        c, P = self.settings, self.runtime.num_params
        if cols is not None:
            if isinstance(cols, bool) or not isinstance(cols, int) or cols < 1 or rows != 1:
                raise ValueError(f"cols: a positive number of values per client (without rows), got {cols!r}")
            P = cols
        if not (isinstance(rows, int) and rows >= 1):
            raise ValueError(f"rows: a positive number of parameter-sized rows per client, got {rows!r}")
        if fill is not None and fill.numel() not in (P, rows * P):
            raise ValueError(f"fill: {P} or {rows * P} values (a client's initial row), got {fill.numel()}")
        init = 0.0 if fill is None else (fill.repeat(rows) if fill.numel() == P else fill).detach().float().cpu()
        dtype = torch.bfloat16 if c.state_dtype == "bfloat16" and not float32 else torch.float32
        limit = None
        if c.state_store == "auto":  # the table's memory: state_memory_gb, else a quarter of its device's
            where = torch.device("cpu") if c.state_on_host else self.device
            limit = int(c.state_memory_gb * 2**30) if c.state_memory_gb else _free_bytes(where) // 4
        with self.guard(
            f"allocating the per-client state store of {name or self.method.name}", "state_dtype", next_round=1, chunk=0
        ):
            return ClientState(
                num_clients,
                rows * P,
                device=self.device,
                pin_memory=c.state_on_host,
                dtype=dtype,
                fill=init,
                store=c.state_store,
                directory=self.state_dir,
                memory_budget=limit,
                name=name or "client-state-" + re.sub(r"[^A-Za-z0-9_.+-]", "_", self.method.name),
                max_rows=1 + min(num_clients, c.rounds * self.max_cohort),
            )
