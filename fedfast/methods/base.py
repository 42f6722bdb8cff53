"""The method contract: what a federated method is to the engine, and what the engine offers a method.

A method is a small class that owns everything about itself (``docs/methods.md`` walks through one):

* ``Options`` - a dataclass of its options with the papers' defaults, one :func:`opt` per field naming the
  equation or table it comes from (``fedfast methods NAME`` prints them; TOML ``[name]`` tables and
  ``--set name.key=value`` set them);
* the client loss (``loss``), the terms the fused client step adds (``step_terms``), the server rule
  (``server``) and its state (server tensors and per-client rows it allocates in ``setup``);
* ``teacher``: which models it distils from this round (a :class:`TeacherSpec`; the engine turns it into a
  per-round cache or a per-step forward and hands every step the rows it needs as :class:`TeacherRows`).

Every hook works on all of a round's clients at once (rows of the client stack in the round's sorted order).
The engine calls, once, ``prepare_model`` (a method that changes the model: MOON's projection head), then per
round: ``aggregation_weights``, ``round_start``, ``teacher``, ``sam_rho``, then per chunk of clients
``chunk_start``, per local step ``loss`` (twice on a SAM step) and ``step_terms``, ``chunk_end``,
``chunk_aggregate`` and ``collect``; then ``server`` and ``evaluated``. A method never writes attributes on the engine
and the engine reads no method-specific attribute: a method reaches the engine only through :class:`Engine`
(``self.engine``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from .._deprecation import deprecated
from . import options as _options, round as _round
from .hooks import ClientHooks, ServerHooks
from .options import NoOptions, make_options, validate_options


# -- per-round values (Round, Collected: fedfast/methods/round.py) ----------------------------------------------
@dataclass(frozen=True)
class UploadSpec:
    """One thing a client uploads beside its model update, declared for a private run (``Method.upload_spec``):
    ``cols`` values per client (``upload_rows`` gives them, [n, cols]; None: the upload *is* the model update
    ``X_k - g``, whose noised sum the average already releases, so it costs nothing more), and ``scale``: the server
    reads ``scale * (the noised sum of the clients' clipped values)`` where it reads the plain sum without privacy
    (``ctx.increment`` for the target ``"increment"``, else ``ctx.sums[target]``). Each client's update and uploads
    are clipped together, one L2 norm over their concatenation (DP-SCAFFOLD's joint clipping, Noble et al.,
    AISTATS 2022), and every sum gets the update's Gaussian noise, so the round stays one Gaussian mechanism of the
    accounted multiplier. The values' units weigh the upload against the update in that norm."""

    cols: int | None
    scale: float = 1.0


@dataclass(frozen=True)
class StateSpec:
    """A method's per-client state, declared before anything is allocated (``Method.client_state_spec``): ``rows``
    parameter-sized rows per client (``rows * P`` values), or ``cols`` values instead; ``fill`` a client's initial
    row ([P], repeated into every row, or [rows * P]; ``cols``: [cols]; None: zeros); ``float32``: keep fp32 rows
    whatever ``state_dtype`` says. The memory budget sizes the chunk with it; the engine then allocates the store
    (``Method.client_state``, a :class:`fedfast.store.ClientState`) before ``Method.setup``."""

    rows: int = 1
    cols: int | None = None
    fill: Tensor | None = None
    float32: bool = False

    def values(self, num_params: int) -> int:
        """Values per client."""
        return self.cols if self.cols is not None else self.rows * num_params


@dataclass(frozen=True)
class TeacherSpec:
    """What a method distils from in one round: ``models`` [M, P] flat parameter rows; with M > 1, ``weights``
    [M] (summing to 1) mix the M teachers' softmaxes at temperature ``tau`` (FedGKD-VOTE). ``buffers`` [M, B]:
    each teacher's buffers (BatchNorm's running statistics, which a teacher in eval mode normalises with); None:
    the global model's (exact for the global model itself; a method whose teachers are other models of a
    BatchNorm network with running statistics passes theirs)."""

    models: Tensor
    weights: Tensor | None = None
    tau: float = 1.0
    buffers: Tensor | None = None

    @staticmethod
    def of(flat: Tensor, buffers: Tensor | None = None) -> "TeacherSpec":
        """One model (flat parameters [P], its buffers [B] or None: the global model's) as the teacher."""
        return TeacherSpec(flat[None], buffers=None if buffers is None else buffers[None])

    def buffers_of(self, m: int) -> Tensor | None:
        """Teacher ``m``'s buffers [B] (None: the global model's)."""
        return None if self.buffers is None else self.buffers[m]


@dataclass(frozen=True)
class TeacherRows:
    """The teacher for one local step's rows ``R = n_active * B``: ``logits`` [R, C] (one teacher) or [M, R, C]
    with ``weights`` [M]; or ``mixture`` = (P [R, C], negent [R]), the M teachers' mixture cached once per round
    (:func:`fedfast.ops.teacher_mixture`). :meth:`kwargs` are the matching :func:`fedfast.ops.distill` arguments."""

    logits: Tensor | None = None
    weights: Tensor | None = None
    mixture: tuple[Tensor, Tensor] | None = None

    def kwargs(self) -> dict:
        if self.mixture is not None:
            return dict(teacher=None, mixture=self.mixture)
        return dict(teacher=self.logits, teacher_weights=self.weights)


@dataclass(kw_only=True)
class Step:
    """One local step of all active clients (the first ``num_clients`` rows of the stack). Built by keyword."""

    logits: Tensor  # [R, C] student logits, R = num_clients * B (requires grad)
    target: Tensor  # [R] labels; -100 on the padding rows of a client's last partial batch
    segments: Tensor  # [R] the row's client (0 .. num_clients-1)
    num_clients: int
    teacher: TeacherRows | None  # None when the method returned no TeacherSpec this round
    hist: Tensor  # [num_clients, C] label histograms of the active clients
    x: Tensor  # [num_clients, B, ...] the inputs (augmented if augmentation is on)
    valid: Tensor  # [num_clients, B] False on padding rows
    features: Tensor | None = None  # [num_clients, B, F] input of the classifier (features_layer), if
    #                                  ``needs_features``
    params: dict | None = None  # the active clients' parameters {name: [num_clients, *shape]} (autograd
    #                                  leaves: a loss term on them, e.g. the classifier on other inputs)
    perturbed: bool = False  # the second pass of a SAM step (at w + rho g/||g||): no side effects
    bn_valid: Tensor | None = None  # ``valid`` on a step where some client's batch has padding rows, else None: pass
    #                                  it as ``valid=`` to the engine's forwards on ``x`` (BatchNorm's batch
    #                                  statistics then skip the padding, as a per-client loop never sees it)
    epoch: int = 0  # the local epoch and the step within it (random draws keyed by them are the
    step: int = 0  # same for any chunking or number of processes)


@dataclass(frozen=True, kw_only=True)
class ClientData:
    """One slice of the chunk's clients' own data run through their models (``Engine.client_data``): up to ``b``
    samples of each of the n clients, every sample of a client once over the slices, in the client's order in the
    partition, un-augmented. ``rows`` [n, b] int64: the samples' indices in the training set (-1: none, the client
    has fewer); ``y`` [n, b] int64 (-100 where none); ``valid`` [n, b] bool; ``logits`` [n, b, C] float32;
    ``features`` [n, b, F] float32 (the classifier's input) or None; ``start``: the position in each client's data
    of the slice's first sample. All on the engine's device, computed without autograd."""

    rows: Tensor
    y: Tensor
    valid: Tensor
    logits: Tensor
    features: Tensor | None
    start: int


# -- the engine as a method sees it --------------------------------------------------------------------------
@runtime_checkable
class Engine(Protocol):
    """What a method may use of the engine (:class:`fedfast.engine.Simulation` implements it)."""

    device: torch.device
    backend: str | None  # the ops backend (None: automatic)
    num_clients: int  # K, all clients
    num_params: int  # P, parameters of the model
    num_classes: int
    seed: int
    train: Any  # the training set (fedfast.data.ArrayDataset, on the device)
    config: Any  # the engine settings (fedfast.SimConfig: lr, momentum, local_epochs, ...)
    # the settings the built-in methods read, by name
    batch_size: int  # B, the local minibatch size
    clients_per_round: int  # the cohort size the run samples (its expected size under Poisson sampling)
    momentum: float  # the local optimizer's momentum
    weight_decay: float  # the local optimizer's weight decay
    aggregate_weights: str  # "size" (by the clients' sample counts) or "uniform"
    private: bool  # a private run (dp_clip > 0: the server reads the noised sums of the declared uploads)
    label_hist: Tensor  # [K, C] every client's label histogram
    client_sizes: np.ndarray  # [K] every client's number of samples

    @property
    def global_flat(self) -> Tensor: ...  # [P] the model the clients start from this round (read only)

    num_buffers: int  # B, buffer values of the model (BatchNorm's running statistics; 0 without)

    @property
    def global_buffers(self) -> Tensor: ...  # [B] the global model's buffers (read only)

    @property
    def round_index(self) -> int: ...  # 0-based index of the current round

    def server_data(self, name: str): ...  # a server-held split ("val", "aux") or None

    def forward(
        self,
        flat: Tensor,
        x: Tensor,
        *,
        features: bool = False,
        buffers: Tensor | None = None,
        valid: Tensor | None = None,
    ): ...

    # one model (flat parameters [P]) on a batch x [R, ...] -> logits [R, C] (or (features, logits)). ``buffers``
    # [B]: the model's (default the global model's); ``valid`` [R]: the rows BatchNorm's batch statistics take
    # (default all). No forward but a local step's updates running statistics

    def forward_clients(
        self,
        rows: Tensor,
        x: Tensor,
        *,
        features: bool = False,
        buffers: Tensor | None = None,
        valid: Tensor | None = None,
    ): ...

    # n models (rows [n, P], buffers [n, B] or [B]) on x [n, B, ...] -> logits [n, B, C] (or (features [n, B, F],
    # logits)); ``valid`` [n, B] (Step.valid on a step with padding rows)

    def forward_each(
        self,
        flat: Tensor,
        x: Tensor,
        *,
        features: bool = False,
        buffers: Tensor | None = None,
        valid: Tensor | None = None,
    ): ...

    # one model on each client's own batch x [n, B, ...] -> [n, B, C] (or (features, logits)); a model with
    # batch-statistics norms sees each client's batch alone (its valid rows), as in a per-client loop

    def predict(
        self, flat: Tensor, dataset, idx: Tensor | None = None, dtype=torch.float32, buffers: Tensor | None = None
    ) -> Tensor: ...

    # logits [len(idx), C] of one model on rows of a dataset, in large batches, eval mode, no grad

    def eval_mode(self) -> contextlib.AbstractContextManager: ...

    # the model's modules in eval mode inside (frozen references: no dropout, as a teacher)

    def new_client_state(self, fill: Tensor | None = None, rows: int = 1, *, cols: int | None = None): ...

    # a fedfast.store.ClientState [K, rows * P] (dtype and placement from the engine settings), rows = ``fill``;
    # ``cols``: rows of that many values instead. A method's own state is declared (Method.client_state_spec) and
    # allocated by the engine; calling this in setup is deprecated (it goes in the next release)

    def head(self, params, z: Tensor) -> Tensor: ...

    # the model's classifier (its last nn.Linear) of each client on z [n, R, F] -> [n, R, C], with ``params``
    # the step's parameters (Step.params), any {name: [n, *shape]} or flat rows [n, P]

    def head_params(self, params) -> tuple: ...

    # (weight [n, C, F], bias [n, C] or None) of that classifier, from the same kinds of ``params``

    def local_gradients(self, ctx, lo: int, hi: int, batches, *, epoch: int): ...

    # for the chunk's clients at their current parameters: one pass over ``batches`` [hi-lo] minibatches of each
    # client's data (data order of local epoch ``epoch``), yielding per step (s, n_act, grad [n_act, P]), the
    # gradient of each client's minibatch-mean cross-entropy (FedCurv's Fisher)

    def client_params(self, n: int) -> Tensor: ...

    # the live parameter rows [n, P] of the chunk's first n clients (in place updates allowed)

    def client_buffers(self, n: int) -> Tensor: ...

    # the live buffer rows [n, B] of the chunk's first n clients (BatchNorm statistics after their local steps)

    @property
    def feature_width(self) -> int: ...  # F, the classifier's input width (Step.features' last dim)

    def client_data(
        self, ctx, lo: int, hi: int, *, features: bool = False, batch: int | None = None, train_mode: bool = False
    ): ...

    # the chunk's clients' models (stack rows 0:hi-lo, as they are now: trained, in chunk_end and collect) over
    # their own samples, each once, un-augmented, ``batch`` (default batch_size) per client at a time, in eval mode
    # (``train_mode``: the model's training mode, batch statistics without running-statistics updates), without
    # autograd: yields ``ClientData`` (FedProto's prototypes, CCVR's feature statistics, calibration)


# -- the method --------------------------------------------------------------------------------------------
class Method(ClientHooks, ServerHooks):
    """FedAvg (McMahan et al., AISTATS 2017): CE loss, SGD client step, weighted average on the server.
    The base of every method; subclass it and register it with :func:`fedfast.methods.register`.

    Class attributes a method may set:
    ``Options`` (dataclass), ``paper`` (one-line reference), ``max_grad_norm`` / ``aggregation`` (the defaults of
    these engine settings when the config leaves them unset: clipping that the authors' code applies, ``"size"``
    or ``"uniform"`` averaging), ``needs_features`` (the loss needs the classifier's input), ``needs_classifier``
    (the method uses the model's classifier: ``engine.head``, or a head it builds in ``prepare_model``; the engine
    then finds the classifier before ``prepare_model`` and sets ``self.classifier_name``), ``accepts_asd``
    (the ASD add-on may replace its KD term), ``sgd_only`` (why the method's client-step terms are defined for
    SGD only: the engine then refuses ``client_optimizer = "adam" / "adamw"`` with that reason), ``sam`` (its
    ``sam_rho`` may be > 0: the engine sizes each client's memory for SAM's perturbed weights), ``uploads``
    (what each client sends the server beyond its model update: a private run clips it jointly with the update
    where the method declares it, ``upload_spec`` / ``upload_rows``, else refuses the method, naming it),
    ``private_refusal`` (why an upload cannot be bounded at all: a private run refuses the method with it).
    """

    name: ClassVar[str] = ""  # registry name (set by @register)
    table: ClassVar[str] = ""  # the option table's name (default: name)
    paper: ClassVar[str] = (
        "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
    )
    Options: ClassVar[type] = NoOptions
    max_grad_norm: ClassVar[float] = 0.0
    max_grad_norm_source: ClassVar[str] = ""
    aggregation: ClassVar[str] = "size"
    aggregation_fixed: ClassVar[bool] = False  # the method defines its averaging (any other is refused)
    needs_features: ClassVar[bool] = False
    needs_classifier: ClassVar[bool] = False
    accepts_asd: ClassVar[bool] = False
    loss_options: ClassVar[tuple] = ()  # options that only shape the loss ASD replaces (refused with +asd)
    state: ClassVar[tuple] = ()  # (read only for checkpoints of fedfast before automatic state)
    transient: ClassVar[tuple] = ()  # attributes setup() rebuilds from the configuration: not checkpointed
    caveats: ClassVar[str] = ""  # settings under which the method fails at its defaults, and what to change
    #                                     (fedfast methods prints it; check_settings warns when a run uses them)
    sgd_only: ClassVar[str] = ""  # non-empty: why Adam/AdamW client steps are refused
    sam: ClassVar[bool] = False  # the local steps may be SAM steps (sam_rho > 0): memory is sized for them
    uploads: ClassVar[str] = ""  # what a client sends beyond its model update (control variates, logits,
    #                                     label counts, ...): a private run (dp_clip) clips it with the update when
    #                                     the method declares it (upload_spec), else refuses the method, naming this
    private_refusal: ClassVar[str] = ""  # why an upload of the method cannot be bounded: a private run refuses it

    def __init__(self, options: dict | None = None, **kw):
        """``options``: ``{table: Options instance or dict}`` (as the config gives them), or keyword options of
        this method's own table (``FedNTD(beta=0.5)``). Construction resolves and validates the options and does
        nothing else (a SimConfig builds an instance to validate its options; a run builds its own in
        :func:`fedfast.assemble.build`): allocate state in :meth:`setup`."""
        tables = dict(options or {})
        own = tables.get(self.table_name(), {})
        if kw:
            if not isinstance(own, dict):
                raise TypeError("options: pass keyword options or an Options instance, not both")
            own = {**own, **kw}
        self.opts = (
            own
            if isinstance(own, self.Options)
            else make_options(self.table_name(), self.Options, own, method=self.name or type(self).__name__)
        )
        self.resolve()
        validate_options(self.table_name(), self.opts)
        self.engine: Engine | None = None
        # the qualified name of the model's classifier (fedfast.flat.find_classifier), set by the engine before
        # prepare_model when the method needs features or the classifier; None otherwise
        self.classifier_name: str | None = None
        self.client_state = None  # a ClientState the method owns (the engine gathers/scatters its rows)

    @classmethod
    def table_name(cls) -> str:
        return cls.table or cls.name or cls.__name__.lower()

    @classmethod
    def option_tables(cls) -> dict[str, type]:
        """The option tables this method reads: ``{table: Options class}``."""
        return {cls.table_name(): cls.Options}

    def resolve(self) -> None:
        """Fill options left ``None`` whose default is derived from other options."""

    def options(self) -> dict[str, dict]:
        """The resolved options, ``{table: {key: value}}`` (config.json records them)."""
        return {self.table_name(): dataclasses.asdict(self.opts)}

    # -- engine-facing lifecycle -------------------------------------------------------------------------
    def bind(self, engine: Engine) -> None:
        """Attach to an engine and allocate state (called once by the engine)."""
        self.engine = engine
        self.setup()

    def client_state_spec(self, engine: Engine) -> StateSpec | None:
        """The per-client state this method keeps (a :class:`StateSpec`), or None: declared before anything is
        allocated, so the memory budget sizes the chunk with it. ``engine``: the run's facts (``num_params``,
        ``num_buffers``, ``num_classes``, ``global_flat``, ``config``; the chunk's rows do not exist yet); ``self.opts``
        is set. The engine allocates ``self.client_state`` from it before :meth:`setup`."""
        return None

    def setup(self) -> None:
        """Allocate the method's server state (``self.engine`` is set; ``self.client_state`` is allocated from
        :meth:`client_state_spec`)."""

    def prepare_model(self, model, seed: int = 0):
        """The model the clients train (called once, before anything else): ``model`` itself, or a new module
        built from it (MOON's projection head); never modify ``model`` in place."""
        return model

    def check_settings(self, config, model) -> list[str]:
        """Warnings for settings under which this method, with its options, is known to diverge or fall far behind
        FedAvg (its ``caveats``): ``config`` is the run's SimConfig, ``model`` the module the clients train (after
        ``prepare_model``). The engine warns each when the run is built, before its first round."""
        return []

    def uses_teacher(self) -> bool:
        """Whether ``teacher`` can return a teacher (decides the teacher cache; static per run)."""
        return False

    def hold_out(self, train, seed: int = 0):
        """Before partitioning (``fedfast run``): ``(train, {name: dataset})``, the clients' training set and the
        server-held splits this method needs (FedGKD-VOTE's validation split, FedCAD's auxiliary data)."""
        return train, {}

    def state_dict(self) -> dict:
        """The method's state for checkpoints, found without a list: every attribute of the method (but the
        engine, the options, datasets, functions and the attributes named in ``transient``) with its value packed
        as plain data (:func:`pack_state`): tensors, numpy arrays, numbers, strings, ``None``, lists / tuples /
        dicts of them, ``nn.Module`` and optimizer state dicts, ``torch.Generator`` states. An attribute of any
        other type makes checkpointing fail naming it (declare it in ``transient`` if ``setup`` rebuilds it from
        the configuration). The per-client rows (``client_state``) are included. Resume then equals the run never
        stopped for any method, a user's plug-in included."""
        attrs = {}
        skip = set(_NOT_STATE) | set(self.transient)
        for k, v in vars(self).items():
            if k in skip or k.startswith("__") or _is_constant_object(self, v):
                continue
            attrs[k] = pack_state(v, f"{self.name or type(self).__name__}.{k}")
        out = {STATE_FORMAT: 2, "attrs": attrs}
        if self.client_state is not None:
            out["client_state"] = self.client_state.state_dict()  # the written clients' rows only
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (after ``bind``): tensors onto the engine's device, modules, optimizers and
        generators loaded in place, every other value set. The checkpoint must hold exactly the attributes this
        method has after ``setup`` (plus any it created since): a mismatch is a ValueError naming them."""
        if STATE_FORMAT not in state:
            return self._load_declared_state(state)
        have = {
            k
            for k, v in vars(self).items()
            if k not in set(_NOT_STATE) | set(self.transient)
            and not k.startswith("__")
            and not _is_constant_object(self, v)
        }
        missing = sorted(have - set(state["attrs"]))
        if missing:
            raise ValueError(
                f"state: the checkpoint of {self.name} lacks {missing} (written by another version of the method?)"
            )
        if (self.client_state is None) != ("client_state" not in state):
            raise ValueError(
                f"state: {self.name} keeps {'no ' if self.client_state is None else ''}per-client "
                f"state, the checkpoint {'has' if 'client_state' in state else 'has none'}"
            )
        if self.client_state is not None:
            self.client_state.load_state_dict(state["client_state"])
        for k, packed in state["attrs"].items():
            setattr(self, k, unpack_state(packed, getattr(self, k, None), self.engine.device, f"{self.name}.{k}"))

    def _load_declared_state(self, state: dict) -> None:
        """A checkpoint of fedfast <= 0.1.0 before automatic state (its ``state`` names and ``client_state``)."""
        expect = {k for k in self.state if getattr(self, k, None) is not None or k in state}
        if self.client_state is not None:
            expect.add("client_state")
        if set(state) != expect:
            raise ValueError(f"state: {self.name} keeps {sorted(expect)}, the checkpoint has {sorted(state)}")
        for k, v in state.items():
            if k == "client_state":
                self.client_state.load_state_dict(v)
            elif isinstance(getattr(self, k, None), int) and not isinstance(getattr(self, k), bool):
                setattr(self, k, int(v))
            else:
                cur = getattr(self, k, None)
                if cur is not None and tuple(cur.shape) != tuple(v.shape):
                    raise ValueError(f"state: {k} has shape {tuple(v.shape)}, expected {tuple(cur.shape)}")
                setattr(self, k, v.to(self.engine.device).clone())


# -- method state in checkpoints -------------------------------------------------------------------------------
STATE_FORMAT = "__fedfast_method_state__"
_NOT_STATE = ("engine", "opts", "client_state", "classifier_name")


def _is_constant_object(method, v) -> bool:
    """Values that come from the configuration or the engine, not from training: option dataclasses, datasets
    (the engine's and its server-held splits), functions and bound methods."""
    if isinstance(v, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type)):
        return True
    if dataclasses.is_dataclass(v) and not isinstance(v, type) and type(v).__name__ == "Options":
        return True
    return hasattr(v, "batch") and hasattr(v, "num_classes") and hasattr(v, "subset")  # a fedfast dataset


def pack_state(v, where: str):
    """A method attribute as checkpoint data (tensors, numbers, strings, lists and dicts only: what
    ``torch.load(weights_only=True)`` reads back); TypeError naming ``where`` for a value it cannot hold."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if torch.is_tensor(v):
        return v.detach().cpu()
    if isinstance(v, np.ndarray):
        return {"__numpy__": torch.from_numpy(np.ascontiguousarray(v))}
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, torch.nn.Module):
        return {"__module__": {k: t.detach().cpu() for k, t in v.state_dict().items()}}
    if isinstance(v, torch.optim.Optimizer):
        return {"__optimizer__": pack_state(v.state_dict(), where)}
    if isinstance(v, torch.Generator):
        return {"__generator__": v.get_state()}
    if isinstance(v, (list, tuple)):
        return {
            "__tuple__" if isinstance(v, tuple) else "__list__": [
                pack_state(x, f"{where}[{i}]") for i, x in enumerate(v)
            ]
        }
    if isinstance(v, dict) and all(isinstance(k, (str, int)) for k in v):
        return {"__dict__": {k: pack_state(x, f"{where}[{k!r}]") for k, x in v.items()}}
    raise TypeError(
        f"{where}: a {type(v).__module__}.{type(v).__qualname__}, which a checkpoint cannot hold. Keep "
        f"method state in tensors, numpy arrays, numbers, strings, lists/dicts of them, nn.Modules, "
        f"optimizers or torch.Generators; name the attribute in the class's `transient` if setup() "
        f"rebuilds it from the configuration, or override state_dict/load_state_dict"
    )


def unpack_state(p, current, device, where: str):
    """The inverse of :func:`pack_state`: modules, optimizers and generators load into ``current`` in place."""
    if torch.is_tensor(p):
        dev = current.device if torch.is_tensor(current) else device
        return p.to(dev).clone()
    if not isinstance(p, dict):
        return p
    if "__numpy__" in p:
        return p["__numpy__"].numpy().copy()
    if "__module__" in p:
        if not isinstance(current, torch.nn.Module):
            raise ValueError(f"state: {where} is a module in the checkpoint, not in this method")
        try:
            current.load_state_dict({k: t.to(device) for k, t in p["__module__"].items()})
        except RuntimeError as e:  # missing / unexpected keys, other shapes
            raise ValueError(f"state: {where}: {' '.join(str(e).split())[:300]}") from None
        return current
    if "__optimizer__" in p:
        if not isinstance(current, torch.optim.Optimizer):
            raise ValueError(f"state: {where} is an optimizer in the checkpoint, not in this method")
        try:
            current.load_state_dict(unpack_state(p["__optimizer__"], None, device, where))
        except (ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"state: {where}: the optimizer's state does not fit ({e})") from None
        return current
    if "__generator__" in p:
        if not isinstance(current, torch.Generator):
            raise ValueError(f"state: {where} is a torch.Generator in the checkpoint, not in this method")
        current.set_state(p["__generator__"].to(current.get_state().device))
        return current
    if "__list__" in p or "__tuple__" in p:
        items = p.get("__list__", p.get("__tuple__"))
        cur = current if isinstance(current, (list, tuple)) and len(current) == len(items) else [None] * len(items)
        out = [unpack_state(x, c, device, f"{where}[{i}]") for i, (x, c) in enumerate(zip(items, cur, strict=True))]
        return tuple(out) if "__tuple__" in p else out
    if "__dict__" in p:
        cur = current if isinstance(current, dict) else {}
        return {k: unpack_state(x, cur.get(k), device, f"{where}[{k!r}]") for k, x in p["__dict__"].items()}
    return p


__all__ = [
    "Method",
    "Engine",
    "Step",
    "ClientData",
    "TeacherSpec",
    "TeacherRows",
]


_MOVED = {
    "Round": _round,
    "Collected": _round,
    "opt": _options,
    "coerce_option": _options,
    "parse_check": _options,
    "CHECK_VOCABULARY": _options,
}  # name -> its home since issue 61 (the old address for one release)


def __getattr__(name: str):
    if name in _MOVED:
        home = _MOVED[name]
        deprecated(
            f"fedfast.methods.base.{name} moved to {home.__name__}.{name} (or fedfast.methods.{name}); the old "
            f"address goes in the next release"
        )
        return getattr(home, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
