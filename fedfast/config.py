"""Run configuration for ``fedfast run``: known keys with types and defaults; unknown keys and bad values are
rejected with a message naming the key. Values come from a TOML file and ``--set key=value`` overrides.

Top-level keys are the run's own (dataset, partition, model, device, ...) plus the engine's settings (every field
of :class:`fedfast.simconfig.SimConfig`). A method's options are its own table: ``[fedntd]`` / ``beta = 1.0`` in
TOML, ``--set fedntd.beta=1.0`` on the command line (``fedfast methods NAME`` lists them). An option table of a
method that is not running is an error naming it and the running method; a key that was a flat option before
the per-method tables (``beta``) is an error naming its new spelling. ``config.json`` records the resolved
values, the running method's options included.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, fields
from types import SimpleNamespace

from . import methods
from ._io import read_json
from .data import DATASETS, PARTITIONS, text_datasets
from .data.authors import default_seed
from .methods.options import coerce_option, make_options
from .models import REGISTRY
from .simconfig import SimConfig, check_device

# keys that were SimConfig fields before method options moved into per-method tables: old key -> new spelling
# (a config file or --set giving one is told the new spelling)
MOVED = {
    "tau": "<method>.tau (e.g. fedntd.tau; asd.tau for the ASD add-on)",
    "beta": "fedntd.beta (kd.beta for kd)",
    "kd_weight": "kd.beta",
    "gamma": "fedgkd.gamma",
    "mu": "fedprox.mu",
    "server_lr": "fedavgm.server_lr",
    "server_momentum": "fedavgm.server_momentum",
    "dyn_alpha": "feddyn.alpha",
    "gkd_buffer": "fedgkd.buffer (fedgkd_vote.buffer)",
    "vote_lambda": "fedgkd_vote.lam",
    "vote_beta": "fedgkd_vote.beta",
    "cad_beta": "fedcad.beta",
    "cad_gamma": "fedcad.gamma",
    "cad_aux_per_class": "fedcad.aux_per_class",
    "cad_tau_squared": "fedcad.tau_squared",
    "cad_alpha_tau": "fedcad.alpha_tau",
    "cad_aux_holdout": "fedcad.aux_holdout",
    "adc_beta": "fedadc.beta",
    "adc_beta_global": "fedadc.beta_global",
    "adc_alpha": "fedadc.alpha",
    "adc_order": "fedadc.order",
    "adc_lam": "fedadc_plus.lam",
    "adc_teacher": "fedadc_plus.teacher",
    "moon_mu": "moon.mu",
    "moon_tau": "moon.tau",
    "asd": "algorithm = '<base>+asd' (e.g. 'fedavg+asd')",
    "lam": "asd.lam",
    "asd_not_true": "asd.not_true",
    "asd_entropy_tau": "asd.entropy_tau",
    "tau_squared": "<method>.tau_squared",
    "val_fraction": "fedgkd_vote.val_fraction",
}


ENTRY_KINDS = ("dataset", "partition", "model")


def _registry(kind: str):
    """The registry a run key names its entry from: datasets, partitions, models."""
    return {"dataset": DATASETS, "partition": PARTITIONS, "model": REGISTRY}[kind]


def _choices() -> dict:
    """The names ``dataset``, ``partition`` and ``model`` may take: the registries' (:mod:`fedfast.data.registry`,
    :data:`fedfast.models.REGISTRY`), read when a config is resolved, so a plug-in's own entries count. A model may
    also be "hf:<hub id or directory>": a Hugging Face sequence classifier (fedfast.models.hf)."""
    return {"dataset": tuple(DATASETS), "partition": tuple(PARTITIONS), "model": tuple(REGISTRY)}


# run-level keys: (type, default)
_RUN: dict = {
    "dataset": (str, "mnist"),
    "data_dir": (str, "data"),
    "partition": (str, "shards"),
    "alpha": (float, 0.1),
    "shards_per_client": (int, 2),
    "num_clients": (int, 100),
    "model": (str, "mlp"),
    "device": (str, "cpu"),
    "checkpoint_every": (int, 10),  # rounds between checkpoints (0: only at the end and on SIGINT/SIGTERM)
    "tensorboard": (bool, False),  # TensorBoard event files in DIR/tb (the optional `tensorboard` package)
    "max_length": (int, 128),  # text datasets: tokens per text (truncation; padded to the longest)
    "train_fraction": (float, 1.0),  # a seeded random subset of the training set (FedGKD's AG News: 0.5)
    "threads": (int, 0),  # intra-op CPU threads (0: torch's default); config.json records the number used
    "val_fraction": (float, 0.0),  # a seeded random split of the training set held out for model selection
    "split_stream": (str, "fedfast"),  # "fedfast" (the partition's scheme, numpy default_rng) or "authors" (the
    #                                    paper's own code, draw for draw: fedfast.data.authors)
    "split_seed": (int, -1),  # the partition's seed; -1: the run seed ("fedfast") or the authors' own
}
SPLIT_STREAMS = ("fedfast", "authors")
# what config.json records beside the keys (read back, not settings): plug-in content hashes and replaced built-ins
# are checked against the files now (a changed plug-in is refused) rather than taken as settings
RECORDED = ("determinism", "plugin_sha256", "replaced_methods", "replaced_entries", "fingerprint", "world_size")
# run defaults that differ from SimConfig's
_SIM_OVERRIDES = {"rounds": 20, "tune_cpu_allocator": True}  # algorithm: "fedavg" everywhere (SimConfig's)
_ENGINE = [f for f in fields(SimConfig) if f.name != "options"]
KEYS: dict = {**_RUN, **{f.name: f for f in _ENGINE}}
_POSITIVE = ("num_clients", "alpha", "shards_per_client")
_NONNEGATIVE = ("checkpoint_every", "threads")


def _engine_default(f):
    if f.name in _SIM_OVERRIDES:
        return _SIM_OVERRIDES[f.name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


DEFAULTS: dict = {**{k: d for k, (_, d) in _RUN.items()}, **{f.name: _engine_default(f) for f in _ENGINE}}


@dataclass(kw_only=True)
class RunConfig:
    values: dict  # run and engine keys (resolved)
    options: dict  # the method's option tables, {table: {key: value}} as given
    plugins: tuple = ()  # plug-in files that register methods (absolute paths)
    entries: dict = dataclasses.field(default_factory=dict)  # the dataset's, partition's and model's own option
    #                                  tables (resolved, plain values): {name: {key: value}}, by kind in ENTRY_KINDS
    given: frozenset = frozenset()  # the run and engine keys the configuration gave (not defaults)
    data_files: tuple = ()  # a built run's (fedfast.assemble.build_run): the files its data was read from
    code_files: tuple = ()  # ... and the modules of the user's own its build imported (its fingerprint)

    def __getitem__(self, k):
        return self.values[k]

    def replace(self, **values) -> "RunConfig":
        """A copy with run or engine keys ``values`` set (a number resolved at run time, e.g. ``threads``); this
        config is left as it is."""
        unknown = sorted(set(values) - set(self.values))
        if unknown:
            raise KeyError(f"{unknown[0]}: not a run or engine key")
        return dataclasses.replace(self, values={**self.values, **values})

    def entry_options(self, kind: str):
        """The options instance of the run's ``kind`` ("dataset", "partition", "model"), or None when it has no
        options of its own."""
        name = self.values[kind]
        entry = _registry(kind).get(name)
        if entry is None or entry.options is None:
            return None
        return entry.options(**self.entries.get(name, {}))

    def sim_config(self) -> SimConfig:
        """The engine's settings, made (and validated, the method built) once for these values: a run's config, its
        held-out splits and its Simulation share one SimConfig and one method instance."""
        sim = self._engine_values()
        key = repr((sorted(sim.items()), self.options))
        cached = self.__dict__.get("_sim")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_sim"] = (key, SimConfig(options=self.options, **sim))
        return cached[1]

    def _engine_values(self) -> dict:
        sim = {f.name: self.values[f.name] for f in _ENGINE}
        sim["backend"] = sim["backend"] or None
        return sim

    def _keep_sim(self, sim: SimConfig) -> None:
        """``sim`` (made from these values before they were resolved) is the SimConfig of the resolved values too."""
        self.__dict__["_sim"] = (repr((sorted(self._engine_values().items()), self.options)), sim)

    def __getstate__(self):
        """Pickled without the cached SimConfig (its method may be a plug-in's, unknown where it is unpickled)."""
        state = dict(self.__dict__)
        state.pop("_sim", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def to_json(self) -> dict:
        """The resolved configuration: run and engine keys, the method's resolved option tables, the plug-in files
        with their content hashes, and a built-in the running method's name replaces (``register(...,
        replace=True)``)."""
        out = dict(self.values)
        out.update(self.sim_config().method_options())
        out.update({name: dict(t) for name, t in self.entries.items()})
        out["plugins"] = list(self.plugins)
        out["plugin_sha256"] = {p: methods.PLUGINS.get(p) or methods.file_sha256(p) for p in self.plugins}
        rep = methods.replaced(self.values["algorithm"])
        if rep:
            out["replaced_methods"] = rep
        entries = {kind: _registry(kind).replacements(self.values[kind]) for kind in ENTRY_KINDS}
        entries = {k: v for k, v in entries.items() if v}
        if entries:
            out["replaced_entries"] = entries  # {kind: {name: {"replaced": ..., "by": ...}}}
        return out


def check_plugin_hashes(recorded, source: str | None) -> None:
    """Each plug-in file a run recorded must have the same content now (``--resume``, ``fedfast run
    DIR/config.json``): a changed file would continue or repeat the run with another method."""
    if not recorded:
        return
    if not isinstance(recorded, dict):
        raise ValueError(
            f"plugin_sha256: expected {{file: sha256}}, got {recorded!r}" + (f" (in {source})" if source else "")
        )
    for path, digest in recorded.items():
        try:
            now = methods.file_sha256(path)
        except OSError:
            raise ValueError(
                f"plugins: {path}, recorded by {source or 'the run'}, is gone; restore it to continue "
                f"or repeat this run"
            ) from None
        if now != digest:
            raise ValueError(
                f"plugins: {path} changed since {source or 'the run'} recorded it (sha256 "
                f"{str(digest)[:12]}... then, {now[:12]}... now): continuing or repeating the run would "
                f"mix two versions of the method. Restore the file, or start a new run with --out"
            )


def _coerce(key: str, value):
    spec = KEYS[key]
    if not isinstance(spec, tuple) and str(spec.type) in ("tuple", "<class 'tuple'>"):  # e.g. adam_betas
        if isinstance(value, str):  # --set adam_betas=0.9,0.99 (or [0.9, 0.99])
            value = [v for v in value.strip().strip("[]()").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list of numbers, got {value!r}")
        try:
            return tuple(float(v) for v in value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: expected a list of numbers, got {value!r}") from None
    if isinstance(spec, tuple):  # run keys: (type, default)
        spec = SimpleNamespace(type=spec[0].__name__)
    elif isinstance(value, str) and value.lower() == "auto" and "None" in str(spec.type):
        value = None  # "auto" for a setting whose automatic value is None (client_chunk, memory_budget_gb, ...)
    return coerce_option(key, value, spec)


def _moved(key: str) -> ValueError:
    return ValueError(
        f"{key}: a method option now, spelled {MOVED[key]} (TOML: in the method's table, e.g. "
        f"[fedntd] beta = 1.0; command line: --set fedntd.beta=1.0; `fedfast methods` lists every "
        f"method's options)"
    )


def read_config_file(path: str) -> dict:
    """A TOML config, or a run's ``config.json`` (``fedfast run DIR/config.json`` runs it again); errors name the
    file, the line and, for a key given twice, the key."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ValueError(f"config: {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"config: {path} is a directory (a run directory's settings are {path}/config.json)") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file (not UTF-8 at byte {e.start})") from None
    if path.endswith(".json"):
        data = read_json(path, "config")
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of config keys, got {type(data).__name__}")
        return data
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        where = f"line {m.group(1)}, column {m.group(2)}" if m else "?"
        what = msg[: m.start()].strip() if m else msg
        if m and (what.startswith("Cannot overwrite a value") or what.startswith("Cannot declare")):
            lines = text.splitlines()
            line = lines[int(m.group(1)) - 1] if int(m.group(1)) <= len(lines) else ""
            key = line.split("=", 1)[0].strip().strip("[]").strip() if line else "?"
            raise ValueError(f"{path}, {where}: {key!r} is given twice (a TOML key or table may appear once)") from None
        raise ValueError(f"{path}, {where}: not valid TOML ({what})") from None


def build_config(
    path: str | None = None,
    overrides: list[str] | None = None,
    base: dict | None = None,
    plugins=(),
    source: str | None = None,
    root: str | None = None,
) -> RunConfig:
    """The run's configuration from a TOML file or a run's config.json (``path``) or a dict of the same shape
    (``base``; ``source``: the file it came from, for messages), then ``overrides`` (``key=value`` /
    ``method.key=value``).

    Paths (``data_dir``, and options declared with ``opt(..., path=True)``) are recorded absolute: a relative path
    from ``path`` resolves against that file's directory, one from ``base`` against ``root`` (a study file's
    directory; None: the working directory), one from ``overrides`` against the working directory."""
    raw: dict = {}
    tables: dict = {}
    loaded = dict(base or {})
    if path:
        loaded.update(read_config_file(path))
        source = path
        root = os.path.dirname(os.path.abspath(path))
    check_plugin_hashes(loaded.get("plugin_sha256"), source)
    for k in RECORDED:
        loaded.pop(k, None)
    listed = loaded.pop("plugins", []) or []
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise ValueError(
            f"plugins: expected a list of file paths, got {listed!r}" + (f" (in {source})" if source else "")
        )
    listed = [_path(p, "plugins", root, set()) for p in listed]  # a file's plug-ins: beside the file
    if listed:
        for p in listed:  # they register what the config names (a dataset, a model, a method)
            methods.load_plugin(p)
    plugins = tuple(os.path.abspath(p) for p in plugins)
    plugins = plugins + tuple(p for p in listed if p not in plugins)
    for k, v in loaded.items():
        (tables if isinstance(v, dict) else raw)[k] = v
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set: expected key=value or method.key=value, got {item!r}")
        k, v = (p.strip() for p in item.split("=", 1))
        if "." in k:
            t, key = k.split(".", 1)
            tables.setdefault(t, {})[key] = v
        else:
            raw[k] = v
    from_set = {(p.split("=", 1)[0].strip()) for p in overrides or [] if "=" in p}
    try:
        return _resolve(raw, tables, plugins, root, from_set)
    except (ValueError, TypeError) as e:
        key = str(e).split(":", 1)[0].strip()
        if key in from_set:
            raise type(e)(f"--set {e}") from None
        if source and key.split(".")[0] in loaded:  # a key, or a method table, the file gave
            raise type(e)(f"{source}: {e}") from None
        raise


def _path(value: str, key: str, root: str | None, from_set: set) -> str:
    """``value`` as an absolute path: against ``root`` when it came from a file, the working directory when it
    came from ``--set`` (or there is no file)."""
    value = os.path.expanduser(value)
    if not os.path.isabs(value) and root and key not in from_set:
        value = os.path.join(root, value)
    return os.path.abspath(value)


def _entry_tables(vals: dict, tables: dict, root: str | None, from_set: set) -> dict:
    """The running dataset's, partition's and model's own option tables, taken out of ``tables`` and validated
    (``[name]``, as a method's; paths resolved); a table of an entry that is not running is an error naming it."""
    try:
        method_tables = set(methods.get(vals["algorithm"]).option_tables())
    except (ValueError, TypeError):
        method_tables = set()
    out = {}
    for kind in ENTRY_KINDS:
        name = vals[kind]
        entry = _registry(kind).get(name) if isinstance(name, str) else None
        if entry is None or entry.options is None:
            continue
        if name in method_tables:
            raise ValueError(
                f"{name}: both the {kind} {name!r} and the method {vals['algorithm']} read a table of "
                f"this name; register the {kind} under another name"
            )
        opts = make_options(name, entry.options, tables.pop(name, {}), method=f"{kind} {name!r}")
        vals_ = dataclasses.asdict(opts)
        for f in dataclasses.fields(opts):
            if f.metadata.get("path") and isinstance(vals_[f.name], str) and vals_[f.name]:
                vals_[f.name] = _path(vals_[f.name], f"{name}.{f.name}", root, from_set)
        out[name] = vals_
    for t in tables:
        if t in method_tables:
            continue
        for kind in ENTRY_KINDS:
            e = _registry(kind).get(t)
            if e is not None and e.options is not None:
                raise ValueError(f"{t}: the option table of {kind} {t!r}, but the run's {kind} is {vals[kind]!r}")
            if e is not None and t == vals[kind]:
                raise ValueError(
                    f"{t}: {kind} {t!r} has no options of its own (register_{kind}(..., options=...) declares them)"
                )
    return out


def split_seed(vals: dict) -> int:
    """The seed the partition draws with: ``split_seed`` when given (>= 0); else, for ``split_stream = "authors"``,
    the authors' own (:func:`fedfast.data.authors.default_seed`: FedNTD's code fixes 19940817 for every run;
    FedDyn's seeds with the run seed, FedGKD's with ``1000 * run seed`` as its main.py does), and the run seed for
    fedfast's streams. config.json records the result."""
    if vals.get("split_stream", "fedfast") == "authors":
        seed = default_seed(vals["partition"], vals["seed"], vals.get("dataset"))
        return int(vals["split_seed"]) if vals.get("split_seed", -1) >= 0 else seed
    if vals.get("split_seed", -1) >= 0:
        return int(vals["split_seed"])
    return int(vals["seed"])


def _resolve(
    raw: dict, tables: dict, plugins: tuple, root: str | None = None, from_set: set = frozenset()
) -> RunConfig:
    vals = dict(DEFAULTS)
    for k, v in raw.items():
        if k in MOVED and k not in KEYS:
            raise _moved(k)
        if k not in KEYS:
            raise ValueError(
                f"{k}: unknown config key (known: {', '.join(sorted(KEYS))}; method options go in "
                f"their method's table, e.g. fedntd.beta)"
            )
        vals[k] = _coerce(k, v)
    for k, choices in _choices().items():
        if k == "model" and isinstance(vals[k], str) and vals[k].startswith("hf:"):
            continue
        if vals[k] not in choices:
            raise ValueError(f"{k}: must be one of {choices}, got {vals[k]!r}")
    for k in _POSITIVE:
        if not vals[k] > 0:
            raise ValueError(f"{k}: must be > 0, got {vals[k]!r}")
    for k in _NONNEGATIVE:
        if vals[k] < 0:
            raise ValueError(f"{k}: must be >= 0, got {vals[k]!r}")
    if not 0 <= vals["val_fraction"] < 1:
        raise ValueError(
            f"val_fraction: the fraction of the training set held out for validation, in [0, 1); got "
            f"{vals['val_fraction']!r}"
        )
    if vals["split_stream"] not in SPLIT_STREAMS:
        raise ValueError(f"split_stream: must be one of {SPLIT_STREAMS}, got {vals['split_stream']!r}")
    if vals["split_seed"] < -1:
        raise ValueError(f"split_seed: a seed >= 0, or -1 for the stream's own, got {vals['split_seed']!r}")
    vals["split_seed"] = split_seed(vals)
    if not 0 < vals["train_fraction"] <= 1:
        raise ValueError(f"train_fraction: must lie in (0, 1], got {vals['train_fraction']!r}")
    if vals["max_length"] < 2:
        raise ValueError(f"max_length: must be >= 2, got {vals['max_length']!r}")
    texts = text_datasets()  # text datasets and their classes: they need an "hf:" model
    text, hf = vals["dataset"] in texts, vals["model"].startswith("hf:")
    if text and not hf:
        raise ValueError(
            f"model: dataset {vals['dataset']!r} holds texts; use a Hugging Face model, e.g. "
            f'model = "hf:distilbert-base-uncased" or "hf:/path/to/saved/model"'
        )
    if not text and vals["max_length"] != DEFAULTS["max_length"]:
        raise ValueError(
            f"max_length: tokens per text, for the text datasets ({', '.join(texts)}); "
            f"dataset {vals['dataset']!r} holds images"
        )
    if hf and not text:
        raise ValueError(
            f"model: {vals['model']!r} is a text model; dataset {vals['dataset']!r} holds images "
            f"(text datasets: {', '.join(texts)})"
        )
    if vals["clients_per_round"] > vals["num_clients"]:
        raise ValueError(f"clients_per_round: {vals['clients_per_round']} > num_clients {vals['num_clients']}")
    if vals["backend"] is None:
        vals["backend"] = ""
    check_device(vals["device"])
    vals["data_dir"] = _path(vals["data_dir"], "data_dir", root, from_set)
    entries = _entry_tables(vals, tables, root, from_set)
    cfg = RunConfig(
        values=vals,
        options=tables,
        plugins=tuple(os.path.abspath(p) for p in plugins),
        entries=entries,
        given=frozenset(raw),
    )
    sim = cfg.sim_config()  # validates the engine keys and the method's tables (messages name table.key)
    vals.update({f.name: getattr(sim, f.name) for f in _ENGINE})
    vals["backend"] = vals["backend"] or ""
    cfg._keep_sim(sim)  # the resolved values describe the same SimConfig: the method stays built once
    return cfg
