"""Run configuration for ``fedfast run``: known keys with types and defaults; unknown keys and bad values are
rejected with a message naming the key. Values come from a TOML file and ``--set key=value`` overrides."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass

_CHOICES = {
    "algorithm": ("fedavg", "fedprox", "kd", "fedntd", "fedgkd", "fedcad", "fedavgm", "scaffold", "feddyn"),
    "dataset": ("mnist", "idx", "cifar10", "cifar100", "tiny_imagenet", "synthetic"),
    "partition": ("iid", "shards", "dirichlet", "dirichlet_balanced", "dirichlet_fedgkd", "quantity_skew"),
    "model": ("fedavg_cnn_mnist", "fedavg_cnn_cifar", "asd_cnn_cifar", "asd_cnn_tiny", "fedadc_cnn", "lenet5",
              "simple_cnn", "resnet8_gn", "resnet10_bn", "resnet18_bn", "resnet18_gn", "mlp"),
}

DEFAULTS: dict = {
    "algorithm": "fedntd", "dataset": "mnist", "data_dir": "data", "partition": "shards", "alpha": 0.1,
    "shards_per_client": 2, "num_clients": 100, "clients_per_round": 10, "rounds": 20, "local_epochs": 1,
    "batch_size": 50, "lr": 0.01, "lr_decay": 1.0, "momentum": 0.9, "weight_decay": 1e-5, "model": "mlp",
    "seed": 0, "device": "cpu", "backend": "", "tau": 1.0, "beta": 1.0, "kd_weight": 1.0, "gamma": 0.2, "mu": 0.0,
    "lam": 10.0, "asd": False, "server_lr": 1.0, "server_momentum": 0.9, "dyn_alpha": 0.01,
    "gkd_buffer": 1, "cad_beta": 0.3, "cad_gamma": 0.7,
}
_POSITIVE = ("gkd_buffer", "num_clients", "clients_per_round", "rounds", "local_epochs", "batch_size", "lr", "tau", "alpha",
             "shards_per_client")


@dataclass
class RunConfig:
    values: dict

    def __getitem__(self, k):
        return self.values[k]


def _coerce(key: str, value, default):
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            return bool(value)
        if isinstance(default, int):
            v = int(value)
            if isinstance(value, float) and value != v:
                raise ValueError
            return v
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a {type(default).__name__}, got {value!r}") from None


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
        if k not in DEFAULTS:
            raise ValueError(f"{k}: unknown config key (known: {', '.join(sorted(DEFAULTS))})")
        vals[k] = _coerce(k, v, DEFAULTS[k])
    for k, choices in _CHOICES.items():
        if vals[k] not in choices:
            raise ValueError(f"{k}: must be one of {choices}, got {vals[k]!r}")
    for k in _POSITIVE:
        if not vals[k] > 0:
            raise ValueError(f"{k}: must be > 0, got {vals[k]!r}")
    if vals["clients_per_round"] > vals["num_clients"]:
        raise ValueError(f"clients_per_round: {vals['clients_per_round']} > num_clients {vals['num_clients']}")
    if vals["asd"] and vals["algorithm"] not in ("fedavg", "fedprox", "fedntd"):
        raise ValueError(f"asd: the ASD add-on composes with fedavg, fedprox and fedntd, not {vals['algorithm']!r}")
    return RunConfig(vals)
