"""The run's per-client state stores (:class:`fedfast.store.ClientState`: a method's declared state, FedBN's
per-client BatchNorm rows), built by the engine from their own settings (issue 61: the memory budget sizes the
chunk with the state a method declares; it does not build the store)."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

from .._settings import Settings
from ..store.state import ClientState
from .memory import _free_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreSettings(Settings):
    """What the stores read of a run's config: the state's dtype, place (host memory, a file past a memory limit)
    and ``rounds`` (with the largest cohort: how many clients' rows a store can come to hold)."""

    state_dtype: str
    state_on_host: bool
    state_store: str
    state_memory_gb: float | None
    rounds: int


class StateStores:
    """Makes the run's per-client state stores on ``device`` (:meth:`client_state`), in ``state_dir`` when a store
    keeps a file there, sized for ``max_cohort`` clients a round; ``params``: a parameter-sized row's values;
    ``guard(what, key, next_round=, chunk=)``: the memory budget's out-of-memory guard (a context manager);
    ``owner``: the name a store's file takes by default (the method's)."""

    def __init__(
        self,
        settings: StoreSettings,
        device: torch.device,
        *,
        params: int,
        guard: Callable,
        owner: str,
        state_dir: str | None = None,
        max_cohort: int = 1,
    ):
        self.settings = StoreSettings.given(settings)
        self.device, self.params, self.guard, self.owner = device, int(params), guard, owner
        self.state_dir, self.max_cohort = state_dir, max_cohort

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
        ``name``: the store's (its file's) name, default the owner's; ``float32``: whatever ``state_dtype`` says
        (the engine's own store of BatchNorm statistics)."""
        c, P = self.settings, self.params
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
            f"allocating the per-client state store of {name or self.owner}", "state_dtype", next_round=1, chunk=0
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
                name=name or "client-state-" + re.sub(r"[^A-Za-z0-9_.+-]", "_", self.owner),
                max_rows=1 + min(num_clients, c.rounds * self.max_cohort),
            )
