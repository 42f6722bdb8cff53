"""The engine interface a method uses (:class:`fedfast.methods.Engine`): the round's index, server-held data,
forwards of the global model, of each client's model and of any flat parameters, per-client state, the
classifier head, the clients' gradients at their trained weights, and the live client parameter rows."""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from .. import ops
from ..data.datasets import ArrayDataset
from .._io import host_to_device
from ..flat import ClientState, find_classifier, functional_forward
from ..methods.base import Round
from .memory import OutOfMemory, _free_bytes, _gib, _is_oom


class EngineServices:
    """Mixin of :class:`fedfast.Simulation`: the services a method sees."""

    # -- the engine interface a method uses (fedfast.methods.Engine) ---------------------------------------------
    @property
    def round_index(self) -> int:
        return self.rnd

    def server_data(self, name: str):
        return self._splits.get(name)

    @contextlib.contextmanager
    def eval_mode(self):
        was = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was)

    def _features_module(self):
        """The model's classifier (``features_layer``; :func:`fedfast.flat.find_classifier`): its input is
        ``Step.features``. Found when the Simulation is built for a method that declares it needs it, else here."""
        if self._classifier is None:
            if self._classifier_name is None:
                self._classifier_name = find_classifier(self.model, _probe_batch(self.model, self.train),
                                                        self.cfg.features_layer)
            self._classifier = self.model.get_submodule(self._classifier_name)
        return self._classifier

    def forward(self, flat: torch.Tensor, x: torch.Tensor, *, features: bool = False):
        """One model (flat parameters [P]) on a batch: the grouped executor with one client, else functional_call.
        With ``features``: ``(input of the classifier, logits)``."""
        feat = self._features_module() if features else None
        if self._plan is not None:
            pv = {k: v[None] for k, v in self.layout.param_views(flat).items()}
            out = self._plan.forward(pv, x[None], self.model.training, feat)
            return (out[0][0], out[1][0]) if features else out[0]
        fwd = self._fwd if feat is None else functional_forward(self.model, feat)
        return fwd(self.layout.param_views(flat), self.layout.buffer_views(self._buffers0), x)

    def forward_clients(self, rows: torch.Tensor, x: torch.Tensor, *, features: bool = False):
        """Models ``rows`` [n, P] on ``x`` [n, B, ...] (the stack's batched forward)."""
        n = rows.shape[0]
        return self.stack.vmap_forward(x, rows=slice(0, n), params=self.layout.param_views(rows),
                                       features=self._features_module() if features else None)

    def forward_each(self, flat: torch.Tensor, x: torch.Tensor, *, features: bool = False):
        """One model (flat [P]) on each client's own batch ``x`` [n, B, ...] -> [n, B, C] (or (features, logits)).
        Models that normalise with batch statistics see each client's batch alone (a grouped forward, as in a
        per-client loop); other models run once on the n*B rows (the same values, without n weight copies)."""
        n, B = x.shape[0], x.shape[1]
        if self._batch_stats:
            return self.forward_clients(flat.expand(n, -1), x, features=features)
        out = self.forward(flat, x.reshape(n * B, *x.shape[2:]), features=features)
        if features:
            return out[0].reshape(n, B, -1), out[1].reshape(n, B, -1)
        return out.reshape(n, B, -1)

    @torch.no_grad()
    def predict(self, flat: torch.Tensor, dataset: ArrayDataset, idx: torch.Tensor | None = None,
                dtype=torch.float32) -> torch.Tensor:
        """Logits of the model ``flat`` on rows ``idx`` of ``dataset`` (default all), in large batches, eval mode."""
        if idx is None:
            idx = torch.arange(len(dataset), device=self.device)
        out = torch.empty(len(idx), dataset.num_classes, device=self.device, dtype=dtype)
        with self.eval_mode():
            for s in range(0, len(idx), self.eval_batch):
                x, _ = dataset.batch(idx[s:s + self.eval_batch])
                out[s:s + self.eval_batch] = self.forward(flat, x).to(dtype)
        return out

    def new_client_state(self, fill: torch.Tensor | None = None, rows: int = 1) -> ClientState:
        """Per-client state ``[K, rows * P]`` (``rows`` parameter-sized rows per client, e.g. FedCurv's Fisher and
        Fisher-weighted model); ``fill`` [P] repeated into every row."""
        c = self.cfg
        if not (isinstance(rows, int) and rows >= 1):
            raise ValueError(f"rows: a positive number of parameter-sized rows per client, got {rows!r}")
        dtype = torch.bfloat16 if c.state_dtype == "bfloat16" else torch.float32
        need = self.K * rows * self.num_params * (2 if dtype == torch.bfloat16 else 4)
        where = torch.device("cpu") if c.state_on_host else self.device
        free = _free_bytes(where)
        hint = ("state_on_host = true keeps it in (pinned) host memory, rows copied per round; "
                if not c.state_on_host else "") + ("state_dtype = 'bfloat16' halves it" if dtype == torch.float32
                                                   else "fewer clients shrink it")
        if need > free:
            raise OutOfMemory(f"{self.method.name}: per-client state for {self.K} clients x {rows} x {self.num_params} "
                              f"parameters needs {_gib(need)}, {_gib(free)} is free on {where}; {hint}")
        try:
            st = ClientState(self.K, rows * self.num_params, device=self.device, pin_memory=c.state_on_host,
                             dtype=dtype)
        except Exception as e:  # noqa: BLE001
            if not _is_oom(e):
                raise
            raise OutOfMemory(f"{self.method.name}: per-client state for {self.K} clients needs {_gib(need)} "
                              f"({self._memory_state()}); {hint}") from None
        if fill is not None:
            st.data.copy_(fill.repeat(rows).expand(self.K, rows * self.num_params))
        return st

    def head_params(self, params) -> tuple:
        """(weight [n, C, F], bias [n, C] or None) of the classifier (``features_layer``) of n clients, from
        ``{name: [n, *shape]}`` (a step's parameters) or flat rows [n, P]."""
        if self._head_names is None:
            lin = self._features_module()
            prefix = self._classifier_name
            self._head_names = (f"{prefix}.weight", f"{prefix}.bias" if lin.bias is not None else None)
        if torch.is_tensor(params):
            params = self.layout.param_views(params)
        w, b = self._head_names
        return params[w], (params[b] if b is not None else None)

    def head(self, params, z: torch.Tensor) -> torch.Tensor:
        """The classifier (``features_layer``) of each of n clients on ``z`` [n, R, F] -> [n, R, C]."""
        w, b = self.head_params(params)
        out = torch.bmm(z, w.transpose(1, 2))
        return out if b is None else out + b[:, None, :]

    def local_gradients(self, ctx: Round, lo: int, hi: int, batches, *, epoch: int):
        """One pass over ``batches`` [hi-lo] (non-increasing) minibatches of each of the chunk's clients, in the data
        order of local epoch ``epoch``, at their current parameters (stack rows ``0:hi-lo``): yields ``(step,
        n_act, grad)`` with ``grad`` [n_act, P] the gradient of each active client's minibatch-mean cross-entropy
        (a buffer reused by the next step). FedCurv's Fisher information."""
        B = self.cfg.batch_size
        batches = np.asarray(batches, dtype=np.int64)
        if batches.shape != (hi - lo,) or (np.diff(batches) > 0).any() or (batches < 0).any() or \
                (batches > ctx.data_batches[lo:hi]).any():
            raise ValueError(f"batches: {hi - lo} non-increasing counts within each client's minibatches per epoch, "
                             f"got {batches.tolist()}")
        S = int(batches[0]) if len(batches) else 0
        table = self._batch_table(ctx, lo, hi, epoch, S * B)
        table[np.arange(S * B)[None, :] >= (batches * B)[:, None]] = -1
        table = host_to_device(table, self.device)
        buf = self.gradbuf if self.gradbuf is not None else torch.empty(hi - lo, self.num_params, device=self.device)
        for s in range(S):
            n_act = int((batches > s).sum())
            x, y, valid, _ = self._minibatch(ctx, table, lo, n_act, epoch, s)
            pv = self.stack.leaf_views(slice(0, n_act))
            z = self.stack.vmap_forward(x, rows=slice(0, n_act), params=pv).reshape(-1, self.num_classes)
            seg = torch.arange(n_act, device=self.device).repeat_interleave(B)
            loss = ops.distill(z, torch.zeros_like(z.detach()), y.reshape(-1), kd_weight=0.0, segments=seg,
                               num_segments=n_act, reduction="mean", backend=self.backend)
            yield s, n_act, self.stack.flat_grad(loss, pv, buf[:n_act])

    def client_params(self, n: int) -> torch.Tensor:
        return self.stack.params[:n]


def _probe_batch(model: nn.Module, train: ArrayDataset) -> torch.Tensor:
    """Two training inputs (one if there is one) on the model's device: the forward that finds the classifier."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    x, _ = train.batch(torch.arange(min(2, len(train)), device=train.x.device))
    return x.to(dev)
