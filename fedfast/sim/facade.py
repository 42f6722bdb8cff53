"""What a method may touch of the engine: :class:`EngineView` implements the :class:`fedfast.methods.Engine`
protocol, and nothing else, by delegating to the parts of a :class:`fedfast.Simulation` (the model runtime, the
chunk trainer, the round plan's placement, the memory budget and the run state). ``Method.bind`` receives it."""
from __future__ import annotations

import torch

from ..store.state import ClientState
from ..methods.base import Round


class EngineView:
    """The engine as a method sees it (:class:`fedfast.methods.Engine`; ``tests/test_engine_view.py`` keeps the two
    equal). Read-only facts of the run, the current round and global model, forwards, per-client state, the
    classifier head, the clients' gradients and their live parameter rows."""

    __slots__ = ("_sim", "device", "backend", "num_clients", "num_params", "num_classes", "seed", "train", "config",
                 "client_sizes", "num_buffers")

    def __init__(self, sim):
        self._sim = sim
        self.device, self.backend, self.seed, self.config = sim.device, sim.cfg.backend, sim.cfg.seed, sim.cfg
        self.num_clients, self.num_params, self.num_classes = sim.num_clients, sim.num_params, sim.num_classes
        self.train, self.client_sizes = sim.train, sim.plan.client_sizes
        self.num_buffers = sim.runtime.num_buffers

    @property
    def label_hist(self) -> torch.Tensor:
        """[K, C] every client's label counts (made on first use)."""
        return self._sim.plan.label_hist

    @property
    def global_flat(self) -> torch.Tensor:
        """[P] the model the clients start from this round."""
        return self._sim.state.global_flat

    @property
    def global_buffers(self) -> torch.Tensor:
        """[B] the global model's buffers (BatchNorm's running statistics; empty without)."""
        return self._sim.state.global_buffers

    @property
    def round_index(self) -> int:
        """0-based index of the current round."""
        return self._sim.state.round

    def server_data(self, name: str):
        """A server-held split ("val", "aux") or None."""
        return self._sim.server_splits.get(name)

    def eval_mode(self):
        return self._sim.runtime.eval_mode()

    def forward(self, flat: torch.Tensor, x: torch.Tensor, *, features: bool = False,
                buffers: torch.Tensor | None = None, valid: torch.Tensor | None = None):
        return self._sim.runtime.forward(flat, x, features=features, buffers=buffers, valid=valid)

    def forward_clients(self, rows: torch.Tensor, x: torch.Tensor, *, features: bool = False,
                        buffers: torch.Tensor | None = None, valid: torch.Tensor | None = None):
        """Models ``rows`` [n, P] (buffers [n, B] or [B], default the global model's) on ``x`` [n, B, ...] (the
        trainer stack's batched forward)."""
        rt, n = self._sim.runtime, rows.shape[0]
        b = rt.buffers if buffers is None else buffers
        return self._sim.trainer.stack.vmap_forward(
            x, rows=slice(0, n), params=rt.layout.param_views(rows), features=rt.features_module() if features else None,
            buffers=rt.layout.buffer_views(b.expand(n, -1) if b.dim() == 1 else b), valid=valid)

    def forward_each(self, flat: torch.Tensor, x: torch.Tensor, *, features: bool = False,
                     buffers: torch.Tensor | None = None, valid: torch.Tensor | None = None):
        """One model (flat [P]) on each client's own batch ``x`` [n, B, ...] -> [n, B, C] (or (features, logits)).
        Models that normalise with batch statistics see each client's batch alone (a grouped forward, as in a
        per-client loop); other models run once on the n*B rows (the same values, without n weight copies)."""
        n, B = x.shape[0], x.shape[1]
        if self._sim.runtime.batch_stats:
            return self.forward_clients(flat.expand(n, -1), x, features=features, buffers=buffers, valid=valid)
        out = self.forward(flat, x.reshape(n * B, *x.shape[2:]), features=features, buffers=buffers)
        if features:
            return out[0].reshape(n, B, -1), out[1].reshape(n, B, -1)
        return out.reshape(n, B, -1)

    def predict(self, flat: torch.Tensor, dataset, idx: torch.Tensor | None = None, dtype=torch.float32,
                buffers: torch.Tensor | None = None):
        return self._sim.runtime.predict(flat, dataset, idx, dtype, buffers)

    def new_client_state(self, fill: torch.Tensor | None = None, rows: int = 1, *,
                         cols: int | None = None) -> ClientState:
        """Per-client state ``[K, rows * P]`` (``rows`` parameter-sized rows per client, e.g. FedCurv's Fisher and
        Fisher-weighted model); ``fill`` [P] repeated into every row; ``cols``: rows of ``cols`` values instead
        (``fill`` then [cols])."""
        return self._sim.budget.client_state(self.num_clients, fill, rows, cols=cols)

    def head_params(self, params) -> tuple:
        return self._sim.runtime.head_params(params)

    def head(self, params, z: torch.Tensor) -> torch.Tensor:
        return self._sim.runtime.head(params, z)

    def local_gradients(self, ctx: Round, lo: int, hi: int, batches, *, epoch: int):
        return self._sim.trainer.local_gradients(ctx, lo, hi, batches, epoch=epoch, gen=self._sim.state.augment)

    def client_params(self, n: int) -> torch.Tensor:
        """The live parameter rows [n, P] of the chunk's first n clients (in place updates allowed)."""
        return self._sim.trainer.stack.params[:n]

    @property
    def feature_width(self) -> int:
        """F, the classifier's input width (``Step.features`` is ``[n, B, F]``)."""
        return self._sim.runtime.features_module().in_features

    def client_data(self, ctx: Round, lo: int, hi: int, *, features: bool = False, batch: int | None = None,
                    train_mode: bool = False):
        """The chunk's clients' models over their own samples, each once, un-augmented, in slices of ``batch`` per
        client (:meth:`fedfast.sim.trainer.ChunkTrainer.client_data`): yields ``fedfast.methods.ClientData``."""
        return self._sim.trainer.client_data(ctx, lo, hi, features=features, batch=batch, train_mode=train_mode)

    def client_buffers(self, n: int) -> torch.Tensor:
        """The live buffer rows [n, B] of the chunk's first n clients (BatchNorm's running statistics as their
        local steps left them)."""
        return self._sim.trainer.stack.buffers[:n]
