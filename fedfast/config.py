"""Run configuration for ``fedfast run``: known keys with types and defaults; unknown keys and bad values are
rejected with a message naming the key. Values come from a TOML file and ``--set key=value`` overrides.

Keys are the run's own (dataset, partition, model, device, ...) plus every field of
:class:`fedfast.engine.SimConfig` (method options). A method option left unset (``None`` here) takes the
paper's default for the chosen algorithm (SimConfig resolves it; ``config.json`` records the resolved value).
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields

from .engine import SimConfig

_CHOICES = {
    "dataset": ("mnist", "idx", "cifar10", "cifar100", "tiny_imagenet", "synthetic"),
    "partition": ("iid", "shards", "dirichlet", "dirichlet_balanced", "dirichlet_fedgkd", "quantity_skew"),
    "model": ("fedavg_cnn_mnist", "fedavg_cnn_cifar", "asd_cnn_cifar", "asd_cnn_tiny", "fedadc_cnn", "lenet5",
              "simple_cnn", "resnet8_gn", "resnet10_bn", "resnet18_bn", "resnet18_gn", "mlp"),
}

# run-level keys: (type, default)
_RUN: dict = {
    "dataset": (str, "mnist"), "data_dir": (str, "data"), "partition": (str, "shards"), "alpha": (float, 0.1),
    "shards_per_client": (int, 2), "num_clients": (int, 100), "model": (str, "mlp"), "device": (str, "cpu"),
    "val_fraction": (float, 0.1),  # FedGKD-VOTE: the server-held validation split (last 10% of the training set)
    "cad_aux_holdout": (bool, False),  # FedCAD: remove the auxiliary samples from the clients' data (strict setting)
}
# run defaults that differ from SimConfig's
_SIM_OVERRIDES = {"algorithm": "fedntd", "rounds": 20, "tune_cpu_allocator": True}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _sim_keys() -> dict:
    out = {}
    defaults = SimConfig.__dataclass_fields__
    for f in fields(SimConfig):
        ann = str(f.type).replace(" ", "")
        base = ann.split("|")[0]
        out[f.name] = (_TYPES[base], _SIM_OVERRIDES.get(f.name, defaults[f.name].default))
    return out


KEYS: dict = {**_RUN, **_sim_keys()}
DEFAULTS: dict = {k: d for k, (_, d) in KEYS.items()}
_POSITIVE = ("num_clients", "alpha", "shards_per_client")


@dataclass
class RunConfig:
    values: dict

    def __getitem__(self, k):
        return self.values[k]

    def sim_config(self) -> SimConfig:
        sim = {f.name: self.values[f.name] for f in fields(SimConfig)}
        sim["backend"] = sim["backend"] or None
        return SimConfig(**sim)


def _coerce(key: str, value, typ):
    if value is None or (isinstance(value, str) and value.lower() in ("none", "auto") and typ is not str):
        return None
    try:
        if typ is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            return bool(value)
        if typ is int:
            v = int(value)
            if isinstance(value, float) and value != v:
                raise ValueError
            return v
        if typ is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a {typ.__name__}, got {value!r}") from None


def build_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    vals = dict(DEFAULTS)
    raw: dict = {}
    if path:
        with open(path, "rb") as f:
            raw.update(tomllib.load(f))
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set: expected key=value, got {item!r}")
        k, v = item.split("=", 1)
        raw[k.strip()] = v.strip()
    for k, v in raw.items():
        if k not in KEYS:
            raise ValueError(f"{k}: unknown config key (known: {', '.join(sorted(KEYS))})")
        vals[k] = _coerce(k, v, KEYS[k][0])
    for k, choices in _CHOICES.items():
        if vals[k] not in choices:
            raise ValueError(f"{k}: must be one of {choices}, got {vals[k]!r}")
    for k in _POSITIVE:
        if not vals[k] > 0:
            raise ValueError(f"{k}: must be > 0, got {vals[k]!r}")
    if not 0.0 < vals["val_fraction"] < 1.0:
        raise ValueError(f"val_fraction: must lie in (0, 1), got {vals['val_fraction']!r}")
    if vals["clients_per_round"] > vals["num_clients"]:
        raise ValueError(f"clients_per_round: {vals['clients_per_round']} > num_clients {vals['num_clients']}")
    cfg = RunConfig(vals)
    sim = cfg.sim_config()  # validates the method options (messages name the key) and fills per-method defaults
    vals.update({f.name: getattr(sim, f.name) for f in fields(SimConfig)})
    vals["backend"] = vals["backend"] or ""
    return cfg
