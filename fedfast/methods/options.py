"""A method's options: each field of its ``Options`` dataclass declared with :func:`opt` (the paper's default, the
equation or table it comes from, and an optional constraint), coerced from TOML / ``--set`` strings
(:func:`coerce_option`), checked (:func:`validate_options`) and built (:func:`make_options`); ``fedfast methods NAME``
prints them."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field

import numpy as np

_NUM = r"[-+]?(?:inf|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
_COMPARE = re.compile(rf"^\s*(>=|<=|>|<)\s*({_NUM})\s*$")
_INTERVAL = re.compile(rf"^\s*([\[(])\s*({_NUM})\s*,\s*({_NUM})\s*([\])])\s*$")
CHECK_VOCABULARY = (
    "'>x', '>=x', '<x', '<=x', or an interval '[a,b]', '(a,b)', '[a,b)', '(a,b]' (x, a, b numbers "
    "or inf; e.g. '>0', '[0,1)', '(0,inf)')"
)


def parse_check(check: str):
    """``(predicate, description)`` of a ``check`` string (:data:`CHECK_VOCABULARY`); ValueError otherwise."""
    m = _COMPARE.match(check) if isinstance(check, str) else None
    if m:
        op, x = m.group(1), float(m.group(2))
        fn = {">": lambda v: v > x, ">=": lambda v: v >= x, "<": lambda v: v < x, "<=": lambda v: v <= x}[op]
        return fn, f"{op} {m.group(2)}"
    m = _INTERVAL.match(check) if isinstance(check, str) else None
    if m:
        lo_open, a, b, hi_open = m.group(1) == "(", float(m.group(2)), float(m.group(3)), m.group(4) == ")"
        if not a <= b:
            raise ValueError(f"check {check!r}: an empty interval")

        def fn(v):
            return (a < v if lo_open else a <= v) and (v < b if hi_open else v <= b)

        return fn, f"in {m.group(1)}{m.group(2)}, {m.group(3)}{m.group(4)}"
    raise ValueError(f"check {check!r}: not a check; use {CHECK_VOCABULARY}")


def opt(default, doc: str, *, check: str | None = None, choices: tuple | None = None, path: bool = False):
    """A method option: its default, one line naming where the default comes from (equation, table, code),
    and an optional constraint: ``check`` (:data:`CHECK_VOCABULARY`: ``">0"``, ``">=1"``, ``"[0,1]"``,
    ``"(0,1]"``, ``"[0,1)"``, ...) or ``choices``. ``None`` as default means "derived from the other options" (the
    doc says how). ``path=True``: a file or directory (a dataset's, say), recorded absolute, a relative one
    resolved against the config or study file it is written in. A bad ``check`` is a ValueError naming the file
    and line of the ``opt(...)`` call."""
    if check is not None:
        try:
            parse_check(check)
        except ValueError as e:
            caller = sys._getframe(1)
            raise ValueError(f"{caller.f_code.co_filename}, line {caller.f_lineno}: opt(check=...): {e}") from None
    if choices is not None and not isinstance(choices, (tuple, list)):
        caller = sys._getframe(1)
        raise ValueError(
            f"{caller.f_code.co_filename}, line {caller.f_lineno}: opt(choices=...): expected a tuple of "
            f"allowed values, got {choices!r}"
        )
    return field(default=default, metadata={"doc": doc, "check": check, "choices": choices, "path": bool(path)})


_TYPES = {"float": float, "int": int, "bool": bool, "str": str}


def _option_type(f) -> tuple[type, bool]:
    """(base type, nullable) of an option field, whether its annotation is a type or a string."""
    if isinstance(f.type, type):
        return (f.type if f.type in _TYPES.values() else str), False
    ann = str(f.type).replace(" ", "").replace("typing.", "")
    if ann.startswith("Optional[") and ann.endswith("]"):
        ann = ann[9:-1] + "|None"
    parts = [p.replace("<class'", "").replace("'>", "") for p in ann.split("|")]
    base = next((p for p in parts if p != "None" and p != "NoneType"), "str")
    return _TYPES.get(base, str), "None" in parts or "NoneType" in parts


_KIND = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def coerce_option(key: str, value, f: dataclasses.Field):
    """``value`` (from TOML, ``--set`` strings or Python) as the field's type; ValueError naming ``key``."""
    typ, nullable = _option_type(f)
    if value is None or (isinstance(value, str) and value.lower() == "none" and typ is not str):
        if nullable:
            return None
        raise ValueError(f"{key}: expected {_KIND.get(typ, 'a ' + typ.__name__)}, got None")
    try:
        if typ is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            if not isinstance(value, (bool, int, np.bool_)):
                raise ValueError
            return bool(value)
        if typ is int:
            v = int(value)
            if isinstance(value, float) and value != v or isinstance(value, bool):
                raise ValueError
            return v
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            v = float(value)
            if not math.isfinite(v):
                raise ValueError(f"{key}: expected a finite number, got {value!r}")
            return v
        if not isinstance(value, str):
            raise ValueError
        return value
    except (TypeError, ValueError) as e:
        if str(e).startswith(f"{key}: "):
            raise
        raise ValueError(f"{key}: expected {_KIND.get(typ, 'a ' + typ.__name__)}, got {value!r}") from None


def validate_options(table: str, opts) -> None:
    """The ``check``/``choices`` constraints of every field; errors name ``table.key``."""
    for f in dataclasses.fields(opts):
        v = getattr(opts, f.name)
        if v is None:
            continue
        chk, choices = f.metadata.get("check"), f.metadata.get("choices")
        if choices is not None and v not in choices:
            raise ValueError(f"{table}.{f.name}: one of {choices}, got {v!r}")
        if chk is not None:
            ok, what = parse_check(chk)
            if not ok(v):
                raise ValueError(f"{table}.{f.name}: must be {what}, got {v!r}")


def make_options(table: str, cls, values: dict | None = None, *, method: str = ""):
    """An ``Options`` instance from a dict (TOML table, ``--set`` values or Python); unknown keys are errors
    naming ``table.key`` and the method."""
    values = dict(values or {})
    known = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in values.items():
        if k not in known:
            raise ValueError(
                f"{table}.{k}: not an option of {method or table} (its options: {', '.join(known) or 'none'})"
            )
        kw[k] = coerce_option(f"{table}.{k}", v, known[k])
    out = cls(**kw)
    validate_options(table, out)
    return out


@dataclass
class NoOptions:
    """A method without options of its own."""


__all__ = ["opt", "make_options", "validate_options", "coerce_option", "parse_check", "CHECK_VOCABULARY", "NoOptions"]
