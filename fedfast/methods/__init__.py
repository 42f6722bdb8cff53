"""Federated methods, one file per family, and their registry.

``register("name")`` adds a :class:`Method` subclass; ``get("name")`` returns it (``"base+asd"``: the base method
with the ASD add-on, :mod:`fedfast.methods.asd`); ``build(name, options)`` makes an instance with validated
options; ``describe(name)`` is the text ``fedfast methods NAME`` prints. A user's method is registered the same
way from the user's own file (``fedfast run --plugin FILE``; ``examples/custom_method.py``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import textwrap

from .base import (Engine, Method, NoOptions, Round, Step, TeacherRows, TeacherSpec, cross_entropy, make_options,
                   opt, validate_options, weighted_mean_rows)

REGISTRY: dict[str, type[Method]] = {}


def register(name: str):
    """Class decorator: register a :class:`Method` subclass under ``name`` (lower-case, no ``+``)."""
    if not isinstance(name, str) or not name or "+" in name or name != name.lower() or "." in name:
        raise ValueError(f"name: a lower-case method name without '+' or '.', got {name!r}")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise TypeError(f"register({name!r}): expected a fedfast.methods.Method subclass, got {cls!r}")
        if not dataclasses.is_dataclass(cls.Options):
            raise TypeError(f"{name}.Options: must be a dataclass")
        cls.name = name
        if "table" not in cls.__dict__ or not cls.__dict__["table"]:
            cls.table = name
        REGISTRY[name] = cls
        return cls
    return deco


def get(name: str) -> type[Method]:
    """The method class registered as ``name``; ``"base+asd"`` composes the ASD add-on over ``base``."""
    if not isinstance(name, str):
        raise TypeError(f"algorithm: expected a method name, got {type(name).__name__}")
    if name.endswith("+asd"):
        from .asd import with_asd
        return with_asd(get(name[:-4]))
    if name not in REGISTRY:
        raise ValueError(f"algorithm: one of {', '.join(names())}, got {name!r}")
    return REGISTRY[name]


def names(asd: bool = True) -> list[str]:
    out = sorted(REGISTRY)
    if asd:
        out += [f"{n}+asd" for n in sorted(REGISTRY) if REGISTRY[n].accepts_asd]
    return out


def tables() -> dict[str, list[str]]:
    """Every option table and the methods that read it (for error messages naming a table's owner)."""
    out: dict[str, list[str]] = {}
    for n in names():
        for t in get(n).option_tables():
            out.setdefault(t, []).append(n)
    return out


def build(name: str, options: dict | None = None) -> Method:
    """An instance of method ``name`` with ``options`` = ``{table: {key: value}}``; a table the method does not
    read is an error naming it and the method."""
    cls = get(name)
    options = dict(options or {})
    own = cls.option_tables()
    for t in options:
        if t not in own:
            owners = tables().get(t)
            where = f"an option table of {', '.join(owners)}" if owners else "not an option table of any method"
            raise ValueError(f"{t}: {where}, but the running method is {name} (its tables: {', '.join(own)})")
    return cls(options)


def load_plugin(path: str) -> None:
    """Import a user's Python file that registers methods (``fedfast run --plugin FILE``)."""
    if not os.path.isfile(path):
        raise ValueError(f"--plugin: no such file {path!r}")
    mod_name = "fedfast_plugin_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        sys.modules.pop(mod_name, None)
        raise ValueError(f"--plugin: {path}, line {e.lineno}: {e.msg}") from None
    except ImportError as e:
        sys.modules.pop(mod_name, None)
        raise ValueError(f"--plugin: {path}: {e}") from None


def describe(name: str, full: bool = True) -> str:
    """A method's options with defaults and sources, its engine defaults and paper (``fedfast methods``)."""
    cls = get(name)
    doc = (cls.__doc__ or "").strip()
    first = " ".join(doc.split("\n\n")[0].split())
    lines = [f"{name}: {first}", f"  paper: {cls.paper}"]
    eng = [f"aggregation={cls.aggregation!r}{' (fixed)' if cls.aggregation_fixed else ''}"]
    if cls.max_grad_norm:
        eng.append(f"max_grad_norm={cls.max_grad_norm:g} ({cls.max_grad_norm_source})")
    lines.append("  engine defaults: " + ", ".join(eng))
    for t, ocls in cls.option_tables().items():
        fs = dataclasses.fields(ocls)
        if not fs:
            lines.append(f"  [{t}] (no options)")
            continue
        lines.append(f"  [{t}]")
        unused = getattr(cls, "base", cls).loss_options if name.endswith("+asd") and t != "asd" else ()
        for f in fs:
            note = " (not used with +asd: ASD replaces this KD term)" if f.name in unused else ""
            lines.append(f"    {f.name} = {f.default!r}".ljust(36) + f"  {f.metadata.get('doc', '')}{note}")
    if full and "\n\n" in doc:
        lines.append("")
        lines.append(textwrap.indent(textwrap.dedent(doc.split("\n\n", 1)[1]), "  "))
    return "\n".join(lines)


# the built-in methods register themselves
from . import fedavg, kd, fedgkd, fedcad, scaffold, feddyn, fedadc, moon, asd  # noqa: E402,F401
from . import fedcurv, feddisco, feddistill, fedgen, fednova, fedrs, fedsam  # noqa: E402,F401
from .fedavg import FedAvg, FedAvgM, FedProx  # noqa: E402
from .kd import KD, FedLSNTD, FedNTD  # noqa: E402
from .fedgkd import FedGKD, FedGKDPlus, FedGKDVote  # noqa: E402
from .fedcad import FedCAD, FedLSD  # noqa: E402
from .fedcurv import FedCurv  # noqa: E402
from .feddisco import FedDisco  # noqa: E402
from .feddistill import FedDistillPlus  # noqa: E402
from .fedgen import FedGen  # noqa: E402
from .fednova import FedNova  # noqa: E402
from .fedrs import FedRS  # noqa: E402
from .fedsam import FedSAM, FedSpeed  # noqa: E402
from .scaffold import Scaffold  # noqa: E402
from .feddyn import FedDyn  # noqa: E402
from .fedadc import FedADC, FedADCPlus  # noqa: E402
from .moon import MOON  # noqa: E402
from .asd import ASD, with_asd  # noqa: E402

__all__ = ["Method", "Engine", "Round", "Step", "TeacherSpec", "TeacherRows", "opt", "make_options",
           "validate_options", "NoOptions", "cross_entropy", "weighted_mean_rows", "REGISTRY", "register", "get",
           "names", "tables", "build", "load_plugin", "describe", "FedAvg", "FedProx", "FedAvgM", "KD", "FedNTD",
           "FedLSNTD", "FedGKD", "FedGKDPlus", "FedGKDVote", "FedCAD", "FedLSD", "FedCurv", "FedDisco", "FedDistillPlus", "FedGen", "FedNova", "FedRS", "FedSAM", "FedSpeed", "Scaffold", "FedDyn", "FedADC", "FedADCPlus", "MOON", "ASD", "with_asd"]
