"""What a method may touch of the engine: :class:`EngineView` implements the :class:`fedfast.methods.Engine`
protocol, and nothing else, by delegating to the parts of a run - the model runtime, the round plan, the per-client
state stores, the run state, the server-held splits and (once the chunk is sized) the chunk trainer. It holds those
parts, never the :class:`fedfast.Simulation` that wires them. ``Method.bind`` receives it."""

from __future__ import annotations

from typing import Callable

import torch

from .._deprecation import deprecated
from ..data.datasets import ArrayDataset
from ..methods.base import Method, StateSpec
from ..methods.hooks import HookError, describe_value, hook_site
from ..methods.round import Round
from ..simconfig import SimConfig
from ..store.state import ClientState
from .plan import RoundPlan
from .runtime import ModelRuntime
from .sizing import MemoryBudget
from .state import RunState
from .stores import StateStores
from .trainer import ChunkTrainer


class EngineView:
    """The engine as a method sees it (:class:`fedfast.methods.Engine`; ``tests/test_engine_view.py`` keeps the two
    equal). Read-only facts of the run, the current round and global model, forwards, per-client state, the
    classifier head, the clients' gradients and their live parameter rows. Built from the parts before the chunk
    is sized (a method declares its per-client state to it: ``Method.client_state_spec``); the chunk trainer is
    attached once it exists, before ``Method.bind``."""

    __slots__ = (
        "_runtime",
        "_plan",
        "_stores",
        "_state",
        "_splits",
        "_trainer",
        "_binding",
        "device",
        "backend",
        "num_clients",
        "num_params",
        "num_classes",
        "seed",
        "train",
        "config",
        "client_sizes",
        "num_buffers",
        "batch_size",
        "clients_per_round",
        "momentum",
        "weight_decay",
        "aggregate_weights",
        "private",
    )

    def __init__(
        self,
        config: SimConfig,
        *,
        runtime: ModelRuntime,
        plan: RoundPlan,
        stores: StateStores,
        state: RunState,
        train: ArrayDataset,
        server_splits: dict,
        device: torch.device,
    ):
        self._runtime, self._plan, self._stores, self._state = runtime, plan, stores, state
        self._splits, self._trainer, self._binding = server_splits, None, False
        self.device, self.backend, self.seed, self.config = device, config.backend, config.seed, config
        self.num_clients, self.num_params, self.num_classes = plan.num_clients, runtime.num_params, train.num_classes
        self.train, self.client_sizes = train, plan.client_sizes
        self.num_buffers = runtime.num_buffers
        self.batch_size, self.clients_per_round = config.batch_size, config.clients_per_round
        self.momentum, self.weight_decay = config.momentum, config.weight_decay
        self.aggregate_weights, self.private = config.aggregate_weights, bool(config.dp_clip)

    def _attach(self, trainer: ChunkTrainer) -> None:
        """The chunk trainer (the stack's rows, the local gradients, the clients' data), once the chunk is sized."""
        self._trainer = trainer

    @property
    def _tr(self):
        if self._trainer is None:
            raise RuntimeError(
                "the chunk's rows exist once the engine has sized the chunk: a method reads them from "
                "Method.setup on, not in client_state_spec"
            )
        return self._trainer

    @property
    def label_hist(self) -> torch.Tensor:
        """[K, C] every client's label counts (made on first use)."""
        return self._plan.label_hist

    @property
    def global_flat(self) -> torch.Tensor:
        """[P] the model the clients start from this round."""
        return self._state.global_flat

    @property
    def global_buffers(self) -> torch.Tensor:
        """[B] the global model's buffers (BatchNorm's running statistics; empty without)."""
        return self._state.global_buffers

    @property
    def round_index(self) -> int:
        """0-based index of the current round."""
        return self._state.round

    def server_data(self, name: str):
        """A server-held split ("val", "aux") or None."""
        return self._splits.get(name)

    def eval_mode(self):
        return self._runtime.eval_mode()

    def forward(
        self,
        flat: torch.Tensor,
        x: torch.Tensor,
        *,
        features: bool = False,
        buffers: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ):
        return self._runtime.forward(flat, x, features=features, buffers=buffers, valid=valid)

    def forward_clients(
        self,
        rows: torch.Tensor,
        x: torch.Tensor,
        *,
        features: bool = False,
        buffers: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ):
        """Models ``rows`` [n, P] (buffers [n, B] or [B], default the global model's) on ``x`` [n, B, ...] (the
        trainer stack's batched forward)."""
        rt, n = self._runtime, rows.shape[0]
        b = rt.buffers if buffers is None else buffers
        return self._tr.stack.vmap_forward(
            x,
            rows=slice(0, n),
            params=rt.layout.param_views(rows),
            features=rt.features_module() if features else None,
            buffers=rt.layout.buffer_views(b.expand(n, -1) if b.dim() == 1 else b),
            valid=valid,
        )

    def forward_each(
        self,
        flat: torch.Tensor,
        x: torch.Tensor,
        *,
        features: bool = False,
        buffers: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ):
        """One model (flat [P]) on each client's own batch ``x`` [n, B, ...] -> [n, B, C] (or (features, logits)).
        Models that normalise with batch statistics see each client's batch alone (a grouped forward, as in a
        per-client loop); other models run once on the n*B rows (the same values, without n weight copies)."""
        n, B = x.shape[0], x.shape[1]
        if self._runtime.batch_stats:
            return self.forward_clients(flat.expand(n, -1), x, features=features, buffers=buffers, valid=valid)
        out = self.forward(flat, x.reshape(n * B, *x.shape[2:]), features=features, buffers=buffers)
        if features:
            return out[0].reshape(n, B, -1), out[1].reshape(n, B, -1)
        return out.reshape(n, B, -1)

    def predict(
        self,
        flat: torch.Tensor,
        dataset,
        idx: torch.Tensor | None = None,
        dtype=torch.float32,
        buffers: torch.Tensor | None = None,
    ):
        return self._runtime.predict(flat, dataset, idx, dtype, buffers)

    def new_client_state(
        self, fill: torch.Tensor | None = None, rows: int = 1, *, cols: int | None = None
    ) -> ClientState:
        """Per-client state ``[K, rows * P]`` (``rows`` parameter-sized rows per client, e.g. FedCurv's Fisher and
        Fisher-weighted model); ``fill`` [P] repeated into every row; ``cols``: rows of ``cols`` values instead
        (``fill`` then [cols]). Deprecated inside ``Method.setup``: declare the state (``Method.client_state_spec``)
        so the memory budget sizes the chunk with it; the engine then allocates it before ``setup``."""
        if self._binding:
            deprecated(
                "new_client_state in Method.setup is deprecated (it goes in the next release): return "
                "fedfast.methods.StateSpec(rows=..., cols=..., fill=...) from the method's client_state_spec "
                "instead; the engine allocates self.client_state before setup",
                3,
            )
        return self._stores.client_state(self.num_clients, fill, rows, cols=cols)

    def head_params(self, params) -> tuple:
        return self._runtime.head_params(params)

    def head(self, params, z: torch.Tensor) -> torch.Tensor:
        return self._runtime.head(params, z)

    def local_gradients(self, ctx: Round, lo: int, hi: int, batches, *, epoch: int):
        return self._tr.local_gradients(ctx, lo, hi, batches, epoch=epoch, gen=self._state.augment)

    def client_params(self, n: int) -> torch.Tensor:
        """The live parameter rows [n, P] of the chunk's first n clients (in place updates allowed)."""
        return self._tr.stack.params[:n]

    @property
    def feature_width(self) -> int:
        """F, the classifier's input width (``Step.features`` is ``[n, B, F]``)."""
        return self._runtime.features_module().in_features

    def client_data(
        self,
        ctx: Round,
        lo: int,
        hi: int,
        *,
        features: bool = False,
        batch: int | None = None,
        train_mode: bool = False,
    ):
        """The chunk's clients' models over their own samples, each once, un-augmented, in slices of ``batch`` per
        client (:meth:`fedfast.sim.trainer.ChunkTrainer.client_data`): yields ``fedfast.methods.ClientData``."""
        return self._tr.client_data(ctx, lo, hi, features=features, batch=batch, train_mode=train_mode)

    def client_buffers(self, n: int) -> torch.Tensor:
        """The live buffer rows [n, B] of the chunk's first n clients (BatchNorm's running statistics as their
        local steps left them)."""
        return self._tr.stack.buffers[:n]


def bind_method(
    method: Method,
    view: EngineView,
    budget: MemoryBudget,
    stores: StateStores,
    size_chunk: Callable[[], int],
    make_trainer: Callable[[int], ChunkTrainer],
) -> tuple[int, ChunkTrainer]:
    """Wire ``method`` to its engine in the order that needs no back-reference: the method declares its per-client
    state to the view of the parts so far (``Method.client_state_spec``), the budget sizes the chunk with it
    (``size_chunk()``), the chunk trainer is made (``make_trainer(chunk)``) and attached to the view, ``stores``
    allocates the store (``method.client_state``), then ``Method.bind`` runs ``setup``. A plug-in that still
    allocates its state in ``setup`` (deprecated; warned there) has the chunk sized again, and a smaller one made if
    the state needs it. Returns ``(chunk, trainer)``."""
    spec = method.client_state_spec(view)
    if spec is not None and not isinstance(spec, StateSpec):
        raise HookError(
            f"{hook_site(method, 'client_state_spec')}: must return a fedfast.methods.StateSpec or None, "
            f"got {describe_value(spec)}"
        )
    budget.declare(spec.values(view.num_params) if spec is not None else None)
    chunk = size_chunk()
    trainer = make_trainer(chunk)
    view._attach(trainer)
    if spec is not None:
        method.client_state = stores.client_state(
            view.num_clients, spec.fill, spec.rows, cols=spec.cols, float32=spec.float32
        )
    view._binding = True
    try:
        method.bind(view)
    finally:
        view._binding = False
    if spec is None and method.client_state is not None:  # allocated in setup: the chunk sized again with it
        budget.declare(method.client_state.cols)
        smaller = size_chunk()
        if smaller < chunk:
            view._attach(None)
            del trainer  # the larger chunk's buffers go before the smaller one's are made
            chunk, trainer = smaller, make_trainer(smaller)
            view._attach(trainer)
    return chunk, trainer
