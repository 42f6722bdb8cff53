"""Federated methods, one file per family, and their registry.

``register("name")`` adds a :class:`Method` subclass; ``get("name")`` returns it (``"base+asd"``: the base method
with the ASD add-on, :mod:`fedfast.methods.asd`); ``build(name, options)`` makes an instance with validated
options; ``describe(name)`` is the text ``fedfast methods NAME`` prints. A user's method is registered the same
way from the user's own file (``fedfast run --plugin FILE``; ``examples/custom_method.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import os
import sys
import textwrap
import traceback

from .._io import file_sha256, is_installed
from .base import (
    ClientData,
    Engine,
    Method,
    StateSpec,
    Step,
    TeacherRows,
    TeacherSpec,
    UploadSpec,
)
from .hooks import cross_entropy, graph_safe, weighted_mean_rows
from .options import NoOptions, make_options, opt, validate_options
from .registry import BUILTIN, REGISTRY, REPLACED, names, register, replaced, unregister
from .round import Collected, Round, RoundSums

PLUGINS: dict[str, str] = {}  # plug-in files loaded in this process: absolute path -> sha256 of the content
PLUGIN_CODE: dict[str, tuple] = {}  # plug-in file -> the files of the modules it imported from outside the
#                                         Python installation (and fedfast): part of a run's fingerprint


def get(name: str) -> type[Method]:
    """The method class registered as ``name``; ``"base+asd"`` composes the ASD add-on over ``base``."""
    if not isinstance(name, str):
        raise TypeError(f"algorithm: expected a method name, got {type(name).__name__}")
    if name.endswith("+asd"):
        return with_asd(get(name[:-4]))
    if name not in REGISTRY:
        close = difflib.get_close_matches(name, names(), n=3)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(
            f"algorithm: {name!r} is not a registered method.{hint} A method of your own is registered "
            f'by its file: fedfast run --plugin FILE.py (or plugins = ["FILE.py"] in a study file\'s '
            f"[preset]; fedfast.methods.load_plugin(FILE) in Python). Registered: {', '.join(names())}"
        )
    return REGISTRY[name]


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


def plugin_frame(tb, files=None) -> tuple[str, int, str] | None:
    """The innermost frame of a traceback inside a plug-in file: (file, line, function), or None."""
    files = set(PLUGINS) if files is None else set(files)
    hit = None
    for fr in traceback.extract_tb(tb):
        if os.path.abspath(fr.filename) in files:
            hit = (fr.filename, fr.lineno, fr.name)
    return hit


def load_plugin(path: str) -> None:
    """Import a user's Python file that registers methods (``fedfast run --plugin FILE``). Loading the same file
    again (resume, sweeps, workers) is harmless. Any error inside the file is a ValueError naming the file and
    line; ``PLUGINS`` records each loaded file's content hash (a run's ``config.json`` keeps it)."""
    if not os.path.isfile(path):
        raise ValueError(f"--plugin: no such file {path!r}")
    path = os.path.abspath(path)
    digest = file_sha256(path)
    mod_name = "fedfast_plugin_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.modules[mod_name] = mod
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        sys.modules.pop(mod_name, None)
        raise ValueError(f"--plugin: {path}, line {e.lineno}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - a plug-in's own error, named by file and line
        sys.modules.pop(mod_name, None)
        where = plugin_frame(e.__traceback__, [path])
        line = f", line {where[1]}" if where else ""
        raise ValueError(f"--plugin: {path}{line}: {type(e).__name__}: {e}") from None
    PLUGINS[path] = digest
    PLUGIN_CODE[path] = _user_code(mod, [sys.modules[n] for n in set(sys.modules) - before if n != mod_name], path)


def user_code(modules: list) -> tuple:
    """The source files of ``modules`` (and the modules their globals refer to) from outside the Python
    installation and fedfast: a run's own code (:mod:`fedfast.fingerprint`)."""
    return _user_code(None, list(modules), "")


def _user_code(mod, new_modules: list, path: str) -> tuple:
    """The source files of the modules a plug-in uses from outside the Python installation and fedfast: those its
    import brought in, and those its globals refer to (modules, or the modules of its functions and classes),
    followed through their own globals."""
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # fedfast's package

    def user_file(m):
        f = getattr(m, "__file__", None)
        if not f or not os.path.isfile(f) or is_installed(f) or os.path.realpath(f).startswith(own):
            return None
        return os.path.abspath(f)

    def refs(m):
        for v in list(vars(m).values()):
            if inspect.ismodule(v):
                yield v
            elif inspect.isclass(v) or inspect.isfunction(v):
                owner = sys.modules.get(getattr(v, "__module__", None) or "")
                if owner is not None:
                    yield owner

    files, seen, todo = set(), {id(mod)}, [*new_modules, *(refs(mod) if mod is not None else ())]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        f = user_file(m)
        if f is None:
            continue
        files.add(f)
        todo.extend(refs(m))
    files.discard(path)
    return tuple(sorted(files))


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
    if getattr(cls, "caveats", ""):
        lines += textwrap.wrap(
            "caveat: " + " ".join(cls.caveats.split()), 116, initial_indent="  ", subsequent_indent="    "
        )
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


# the built-in methods register themselves, in this order (the order `fedfast methods` lists them in)
# isort: off
from . import fedavg, kd, fedntd, fedgkd, fedcad, scaffold, feddyn, fedadc, moon, asd  # noqa: E402,F401
from . import fedcurv, feddisco, feddistill, fedgen, fednova, fedrs, fedsam  # noqa: E402,F401
from .fedavg import FedAvg, FedAvgM, FedProx  # noqa: E402
from .kd import KD  # noqa: E402
from .fedntd import FedLSNTD, FedNTD  # noqa: E402
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

# isort: on

REGISTRY.seal()

__all__ = [
    "Method",
    "Engine",
    "Round",
    "Step",
    "ClientData",
    "Collected",
    "RoundSums",
    "StateSpec",
    "TeacherSpec",
    "UploadSpec",
    "TeacherRows",
    "opt",
    "make_options",
    "validate_options",
    "NoOptions",
    "cross_entropy",
    "weighted_mean_rows",
    "graph_safe",
    "REGISTRY",
    "register",
    "get",
    "names",
    "tables",
    "build",
    "load_plugin",
    "describe",
    "unregister",
    "replaced",
    "BUILTIN",
    "REPLACED",
    "PLUGINS",
    "PLUGIN_CODE",
    "file_sha256",
    "plugin_frame",
    "FedAvg",
    "FedProx",
    "FedAvgM",
    "KD",
    "FedNTD",
    "FedLSNTD",
    "FedGKD",
    "FedGKDPlus",
    "FedGKDVote",
    "FedCAD",
    "FedLSD",
    "FedCurv",
    "FedDisco",
    "FedDistillPlus",
    "FedGen",
    "FedNova",
    "FedRS",
    "FedSAM",
    "FedSpeed",
    "Scaffold",
    "FedDyn",
    "FedADC",
    "FedADCPlus",
    "MOON",
    "ASD",
    "with_asd",
]
