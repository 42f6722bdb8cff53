"""The model as the engine runs it, fixed after construction: the flat layout of its parameters, the verified
batched executor (:mod:`fedfast.batched`'s traced program, :mod:`fedfast.grouped`'s copy, or vmap), the
functional forward of one flat model, predictions in large batches, eval mode, and the classifier head."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import warnings

import torch
from torch import nn
from torch.func import functional_call

from .. import batched, grouped
from .._settings import Settings
from ..data.datasets import ArrayDataset
from ..flat import FlatLayout, fedfast_batch_norm, find_classifier, functional_forward, has_running_stats
from ..ops import _backend
from .memory import fp32_semantics
from .own_model import HostReads, buffers_kept, forward_effects, model_line

# conv = "auto" by device type. CPU: oneDNN's grouped convolution (benchmarks/bench_conv.py on the 2-core VM, NHWC:
# 1.35-7.9x faster than im2col + GEMM on layers of 16+ input channels; im2col on the thin first layers alone gave
# no faster rounds; docs/benchmarks.md). CUDA: "hybrid" (the implicit-GEMM forward, cuDNN's grouped gradients;
# bench_rounds.py on an H100, one run, benchmarks/results/nvidia-h100-80gb-hbm3-rounds-hybrid*.json: 347 ms per
# round at 1000 clients of simple_cnn against 411 ms for "triton" and 1245 ms for "grouped"; FedNTD's MNIST 324 ms
# against 377 and 425; pfl-research at 50 clients 34.7 ms, all three within 3 %). Without triton it is "grouped".
CONV_AUTO = {"cpu": "grouped", "cuda": "hybrid"}


def conv_impl(setting: str, device: torch.device) -> str:
    """The convolution implementation a run uses: ``setting`` unless "auto"; ValueError where it cannot run."""
    impl = CONV_AUTO.get(device.type, "grouped") if setting == "auto" else setting
    if setting == "auto" and impl in ("triton", "hybrid") and not _backend.available("triton", device.type):
        impl = "grouped"  # the automatic choice needs no optional package
    if impl in ("triton", "hybrid") and not _backend.available("triton", device.type):
        why = _backend.interpreter_problem()
        raise ValueError(
            f"conv: {impl!r} runs on CUDA devices (with triton installed), not {device.type}"
            + (f" ({why})" if why else "")
            + "; use conv = 'grouped' or 'gemm'"
        )
    return impl


def probe_batch(model: nn.Module, train: ArrayDataset) -> torch.Tensor:
    """Two training inputs (one if there is one) on the model's device: the forward that finds the classifier."""
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    x, _ = train.batch(torch.arange(min(2, len(train)), device=train.x.device))
    return x.to(dev)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeSettings(Settings):
    """What the model runtime reads of a run's config: the executor, the convolutions, the evaluation batch and the
    classifier's name."""

    executor: str
    conv: str
    eval_batch: int | None
    features_layer: str | None


def _gradients_differ(kind: str, names: list, g_ref, g_got) -> str:
    """ "" if the executor's parameter gradients equal the model's (to 1e-4 of the largest), else which differs."""
    zero = torch.zeros(())
    scale = max((float(g.abs().max()) for g in g_ref if g is not None), default=0.0)
    for name, a, b in zip(names, g_ref, g_got, strict=True):
        a = zero if a is None else a
        b = zero if b is None else b
        err = float((a - b).abs().max())
        if not err <= 1e-4 * max(scale, 1e-12):
            return (
                f"its {kind}'s gradient of {name!r} differs from the model's ({err:.1e} of {scale:.1e}; a part run "
                f"under torch.no_grad() or detached inside the forward is traced as if it trained)"
            )
    return ""


class ModelRuntime:
    """``model`` (on ``device``) checked on two training samples and flattened: ``layout`` (flat parameters [P],
    buffers [B]: floating-point buffers and BatchNorm's ``num_batches_tracked``), ``plan`` (the batched executor,
    None: vmap), ``conv``, ``batch_stats`` (BatchNorm/InstanceNorm), ``running_stats`` (BatchNorm that keeps
    running statistics), ``initial`` / ``initial_buffers`` (the model's flat parameters and buffers as given),
    ``buffers`` (the global model's buffers, which forwards use unless given others: the engine sets them after
    every round), ``eval_batch``; ``classifier_name`` found by :meth:`find_classifier` (or on first use).
    ``train`` serves the probes only."""

    def __init__(self, settings: RuntimeSettings, model: nn.Module, train: ArrayDataset, device: torch.device):
        self.settings = settings = RuntimeSettings.given(settings)
        self.model, self.train, self.device = model, train, device
        self.eval_batch = settings.eval_batch or (1024 if device.type == "cpu" else 4096)
        for name, mod in model.named_modules():
            if isinstance(mod, nn.modules.instancenorm._InstanceNorm) and mod.track_running_stats:
                raise ValueError(
                    f"model: {name!r} is an InstanceNorm with track_running_stats=True; fedfast keeps "
                    f"per-client running statistics for BatchNorm layers only: use "
                    f"track_running_stats=False (InstanceNorm's default)"
                )
        with buffers_kept(model):
            self.check_model()
        x4, _ = train.batch(torch.arange(min(4, len(train)), device=device))
        effect = forward_effects(model, x4)
        if effect:
            raise ValueError(
                f"model: its training forward changes {effect}; fedfast's executors update only BatchNorm's running "
                f"statistics per client (over each client's own rows, padding left out), so this buffer would not "
                f"follow each client as a loop's model does: compute it outside the model, or keep it constant"
            )
        self.layout = FlatLayout(model)
        self.num_params = self.layout.P
        self.num_buffers = self.layout.B
        self.batch_stats = any(
            isinstance(mod, nn.modules.batchnorm._NormBase) and not isinstance(mod, nn.GroupNorm)
            for mod in model.modules()
        )  # BatchNorm/InstanceNorm: batch statistics
        self.running_stats = has_running_stats(model)
        self.conv = conv_impl(settings.conv, device)
        self.initial_buffers = self.layout.flatten_buffers(model).to(device)
        self.buffers = self.initial_buffers
        self.plan = self._batched_plan()
        self.classifier_name: str | None = None
        self._classifier = None
        self._head_names = None
        self.initial = self.layout.flatten_params(model).to(device)

    # -- set-up ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def check_model(self) -> None:
        """One training sample through the model: it must run on the inputs and output num_classes logits."""
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
        if self.settings.executor == "vmap":
            self._probe_vmap([])
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
        self._probe_vmap(whys)
        warnings.warn(
            f"model: runs through torch.func.vmap(functional_call), not fedfast's batched executors, "
            f"because {whys[0]}, and {whys[1]}; that path measured 1.7x slower per round on a 2-core CPU "
            f"(FedAvg, simple_cnn, 1000 clients x 60, 50 per round). Supported layers: fedfast.batched, "
            f"fedfast.grouped.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None

    def _probe_vmap(self, whys: list) -> None:
        """ValueError naming the model's line when ``torch.func.vmap`` cannot run the model for two clients either
        (an LSTM, ``.item()``, a Python branch on a tensor's value): no executor is left (``whys``: why the
        batched ones were not used)."""
        x, _ = self.train.batch(torch.arange(min(4, len(self.train)), device=self.device))
        flat = self.layout.flatten_params(self.model)
        pv = {k: v.detach()[None].expand(2, *v.shape) for k, v in self.layout.param_views(flat).items()}
        bv = {k: v[None].expand(2, *v.shape) for k, v in self.layout.buffer_views(self.initial_buffers).items()}
        f = functional_forward(self.model)
        try:
            with self.eval_mode(), fedfast_batch_norm(self.model):
                torch.func.vmap(f, randomness="different")(pv, bv, torch.stack([x, x]))
        except Exception as e:  # noqa: BLE001 - the model's own error, named with its line
            line = model_line(e)
            raise ValueError(
                f"model: fedfast cannot run it for many clients at once: torch.func.vmap fails "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
                + (f" at {line}" if line else "")
                + "".join(f"; {w}" for w in whys)
                + " (a forward must not read a tensor's value on the host - .item(), NumPy, an `if` on a tensor - "
                "and each of its layers must have a batching rule: docs/own-model.md)"
            ) from None

    def _probe_executor(self, prog, kind: str) -> str:
        """ "" if ``prog`` reproduces ``functional_call`` of the model for two clients (the model's weights and a
        perturbed copy) on a probe batch of up to 4 training rows, its outputs and its parameters' gradients, else
        why not. The gradients catch what a trace cannot see: a ``torch.no_grad()`` block inside the forward (fx
        records its operations as any others; the program would train the frozen part)."""
        n_rows = len(self.train)
        x0, _ = self.train.batch(torch.arange(min(4, n_rows), device=self.device))
        x1, _ = self.train.batch((torch.arange(len(x0), device=self.device) + len(x0)) % n_rows)
        if n_rows < 2 * len(x0):  # too few rows for two batches: client 1's its own transform of them
            x1 = x0.flip(0) * 0.5 + 0.25 if x0.is_floating_point() else x0.flip(0)
        xs = torch.stack([x0, x1])  # each client its own rows: an executor that mixes the clients' rows fails
        gen = torch.Generator(device="cpu").manual_seed(0)
        pv = {}
        for k, v in self.model.named_parameters():
            noise = torch.randn(v.shape, generator=gen).to(v.device, v.dtype)
            pv[k] = torch.stack([v.detach(), v.detach() + 0.05 * v.detach().abs().mean() * noise]).requires_grad_()
        bv = {k: v[None].expand(2, *v.shape) for k, v in self.layout.buffer_views(self.initial_buffers).items()}
        with self.eval_mode(), fp32_semantics(), torch.enable_grad():  # TF32 would differ by ~1e-3 on both sides
            try:
                ref = torch.stack(
                    [functional_call(self.model, {k: v[i] for k, v in pv.items()}, (xs[i],)).float() for i in range(2)]
                )
                with HostReads() as reads:
                    got = prog.forward(pv, xs, False, buffers=bv).float()
                w = torch.randn(ref.shape, generator=gen).to(ref.device)
                g_ref = torch.autograd.grad((ref * w).sum(), list(pv.values()), allow_unused=True)
                g_got = torch.autograd.grad((got * w).sum(), list(pv.values()), allow_unused=True)
            except Exception as e:  # noqa: BLE001 - any failure of a candidate executor: the next one, saying why
                return f"its {kind} does not run ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
        if reads.weights:  # a value of the weights read on the host: one read for all the clients together
            return f"its forward reads a tensor's value on the host ({reads.weights}): the {kind} would read it once"
        err = float(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).detach())
        if not err <= 1e-4:
            return f"its {kind} differs from the model's forward (relative error {err:.1e})"
        return _gradients_differ(kind, list(pv), g_ref, g_got)

    def find_classifier(self, hint: str | None) -> str:
        """The classifier's name (:func:`fedfast.flat.find_classifier`; ``hint``: a name, e.g. ``features_layer``),
        found by watching a forward of two training samples, and kept."""
        self.classifier_name = find_classifier(self.model, probe_batch(self.model, self.train), hint)
        return self.classifier_name

    @torch.no_grad()
    def activation_elems(self, with_im2col: bool) -> int:
        """Elements of every leaf module's output for two samples (one forward in the model's mode), plus
        im2col's buffer and its gradient for ungrouped convolutions when ``with_im2col``: the budget's
        activation probe."""
        acts = []

        def hook(m, inp, o):
            acts.append(o.numel() if torch.is_tensor(o) else 0)
            if with_im2col and isinstance(m, nn.Conv2d) and m.groups == 1:  # im2col: kept and its gradient
                acts.append(2 * inp[0].numel() * m.kernel_size[0] * m.kernel_size[1] // 3)

        self._probe([m.register_forward_hook(hook) for m in self.model.modules() if not list(m.children())])
        return sum(acts)

    @torch.no_grad()
    def batch_norm_positions(self) -> dict:
        """``{name: S}``: each BatchNorm layer's values per channel and sample in training (its input's spatial
        positions, 1 after a Linear), from one forward of two training samples (the buffers kept)."""
        out = {}
        self._probe(
            [
                m.register_forward_hook(lambda m_, inp, o, n=n: out.__setitem__(n, inp[0][0, 0].numel()))
                for n, m in self.model.named_modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm)
            ]
        )
        return out

    def _probe(self, hooks: list) -> None:
        """One forward of two training samples in the model's mode (its buffers kept), then ``hooks`` removed."""
        try:
            with buffers_kept(self.model):
                self.model(self.train.batch(torch.arange(2, device=self.device) % len(self.train))[0])
        finally:
            for h in hooks:
                h.remove()

    # -- running one model -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def eval_mode(self):
        """The model's modules in eval mode inside the block (then as they were)."""
        was = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was)

    def features_module(self):
        """The model's classifier (``features_layer``; :func:`fedfast.flat.find_classifier`): its input is
        ``Step.features``. Found when the Simulation is built for a method that declares it needs it, else here."""
        if self._classifier is None:
            if self.classifier_name is None:
                self.find_classifier(self.settings.features_layer)
            self._classifier = self.model.get_submodule(self.classifier_name)
        return self._classifier

    def forward(
        self,
        flat: torch.Tensor,
        x: torch.Tensor,
        *,
        features: bool = False,
        buffers: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ):
        """One model (flat parameters [P], ``buffers`` [B], default the global model's) on a batch ``x`` [R, ...]:
        the batched executor with one client, else functional_call. With ``features``: ``(input of the
        classifier, logits)``. ``valid`` [R]: the rows that enter BatchNorm's batch statistics (None: all). Never
        updates running statistics (only a local step's forward does)."""
        feat = self.features_module() if features else None
        b = self.buffers if buffers is None else buffers
        if self.plan is not None:
            pv = {k: v[None] for k, v in self.layout.param_views(flat).items()}
            bv = {k: v[None] for k, v in self.layout.buffer_views(b).items()}
            out = self.plan.forward(
                pv, x[None], self.model.training, feat, buffers=bv, valid=None if valid is None else valid[None]
            )
            return (out[0][0], out[1][0]) if features else out[0]
        fwd = functional_forward(self.model, feat)
        with fedfast_batch_norm(self.model):
            return fwd(self.layout.param_views(flat), self.layout.buffer_views(b), x, valid)

    @torch.no_grad()
    def predict(
        self,
        flat: torch.Tensor,
        dataset: ArrayDataset,
        idx: torch.Tensor | None = None,
        dtype=torch.float32,
        buffers: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the model ``flat`` (with ``buffers``, default the global model's) on rows ``idx`` of
        ``dataset`` (default all), in large batches, eval mode."""
        if idx is None:
            idx = torch.arange(len(dataset), device=self.device)
        out = torch.empty(len(idx), dataset.num_classes, device=self.device, dtype=dtype)
        with self.eval_mode():
            for s in range(0, len(idx), self.eval_batch):
                x, _ = dataset.batch(idx[s : s + self.eval_batch])
                out[s : s + self.eval_batch] = self.forward(flat, x, buffers=buffers).to(dtype)
        return out

    def head_params(self, params) -> tuple:
        """(weight [n, C, F], bias [n, C] or None) of the classifier (``features_layer``) of n clients, from
        ``{name: [n, *shape]}`` (a step's parameters) or flat rows [n, P]."""
        if self._head_names is None:
            lin = self.features_module()
            prefix = self.classifier_name
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

    # -- the trained model -----------------------------------------------------------------------------------
    @torch.no_grad()
    def load_into_model(self, flat: torch.Tensor, buffers: torch.Tensor | None = None) -> None:
        """The model's parameters set to ``flat`` [P], its buffers to ``buffers`` [B] (default the global
        model's)."""
        for p, v in zip(self.model.parameters(), self.layout.param_views(flat).values(), strict=True):
            p.copy_(v)
        self.layout.load_buffers(self.model, self.buffers if buffers is None else buffers)

    def state_dict(self, flat: torch.Tensor) -> dict:
        """``flat`` (with the global model's buffers) as a ``state_dict`` of the model (copies; the model holds
        them after)."""
        self.load_into_model(flat)
        sd = self.model.state_dict()
        out = collections.OrderedDict((k, v.detach().clone()) for k, v in sd.items())
        out._metadata = copy.deepcopy(getattr(sd, "_metadata", {}))  # module versions: load_state_dict reads them
        return out
