"""One registry for everything a run configuration names: methods (``algorithm``), datasets, partitions and models.

A name another entry already holds is refused, naming both entries and the files they come from: a run would
otherwise report the new entry's numbers under the old name. ``replace=True`` replaces it on purpose; the
replacement is recorded (:meth:`Registry.replacements`), ``config.json`` keeps it and ``fedfast report`` marks the
rows. Registering the same entry again - the same function or class from the same file, or from a file of the same
content (a plug-in loaded again by a resume, a sweep, a worker process) - is harmless.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

from ._io import file_sha256


def _target(value):
    """The function or class that makes an entry what it is (a dataclass entry's first callable field)."""
    if callable(value) and (inspect.isfunction(value) or inspect.isclass(value) or inspect.ismethod(value)):
        return value
    for v in getattr(value, "__dict__", {}).values():
        if inspect.isfunction(v) or inspect.isclass(v):
            return v
    return value


def origin(value) -> tuple[str, str]:
    """``(qualified name[:line], absolute source file)`` of an entry: the file ``register`` was applied in for a
    class (``_registered_in``), the defining file for a function (a lambda: with its line)."""
    t = _target(value)
    f = t.__dict__.get("_registered_in") if inspect.isclass(t) else None
    if f is None:
        try:
            f = inspect.getsourcefile(t) or inspect.getfile(t)
        except (TypeError, OSError):
            f = None
    name = f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', type(t).__name__)}"
    code = getattr(t, "__code__", None)
    if code is not None and t.__name__ == "<lambda>":
        name += f":{code.co_firstlineno}"
    return name, os.path.abspath(f) if f else "<no file>"


def same_source(a, b) -> bool:
    """The same entry loaded again: the same object, or the same qualified name from the same file or from files
    of equal content."""
    if a is b or _target(a) is _target(b):
        return True
    (qa, fa), (qb, fb) = origin(a), origin(b)
    if qa.rsplit(".", 1)[-1] != qb.rsplit(".", 1)[-1]:
        return False
    if fa == fb:
        return fa != "<no file>" or qa == qb
    try:
        return file_sha256(fa) == file_sha256(fb)
    except OSError:
        return False


def check_entry(call: str, name, fn, options) -> None:
    """The arguments of a ``register_*`` call: a non-empty name, a callable, and options that are a dataclass (or
    None); ValueError / TypeError naming the call."""
    if not (isinstance(name, str) and name) or not callable(fn):
        raise ValueError(f"{call}: a non-empty name and a callable, got {name!r}, {fn!r}")
    if options is not None and not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise TypeError(
            f"{call}({name!r}): options must be a dataclass (fields made with fedfast.methods.opt), got {options!r}"
        )


class Registry(dict):
    """``name -> entry`` for one kind of entry (``"method"``, ``"dataset"``, ``"partition"``, ``"model"``), read by
    config validation and the run setup. :meth:`add` registers, :meth:`remove` unregisters (a built-in that was
    replaced comes back), :meth:`seal` marks the entries present as fedfast's built-ins."""

    def __init__(self, kind: str, key: str):
        super().__init__()
        self.kind, self.key = kind, key  # the config key that names an entry (algorithm, dataset, ...)
        self.builtin: dict = {}
        self.replaced: dict[str, dict] = {}  # name -> {"replaced": "module.qualname (file)", "by": ...}

    def add(self, name: str, value, *, replace: bool = False, call: str = "register"):
        """Register ``value`` as ``name`` (see the module docstring); returns ``value``."""
        old = self.get(name)
        if old is not None and old is not value and not same_source(old, value):
            (oq, of), (nq, nf) = origin(old), origin(value)
            if not replace:
                raise ValueError(
                    f"{call}({name!r}): the name {name!r} is taken by {oq} ({of}); {nq} "
                    f"({nf}) would replace it, and every run with {self.key} = {name!r} would silently "
                    f"be {nq}'s. Register it under a name of its own, or with {call}({name!r}, ..., "
                    f"replace=True) to replace it on purpose (the run then records it)"
                )
            base = self.replaced.get(name, {}).get("replaced", f"{oq} ({of})")
            self.replaced[name] = {"replaced": base, "by": f"{nq} ({nf})"}
        self[name] = value
        return value

    def remove(self, name: str) -> None:
        """Unregister ``name``; a built-in it replaced comes back."""
        if name in self.builtin:
            self[name] = self.builtin[name]
        else:
            self.pop(name, None)
        self.replaced.pop(name, None)

    def seal(self) -> None:
        """The entries registered so far are fedfast's own (``remove`` restores them)."""
        self.builtin.update(self)

    def replacements(self, *names: str) -> dict:
        """``{name: {"replaced": ..., "by": ...}}`` for those of ``names`` a plug-in replaced."""
        return {n: dict(self.replaced[n]) for n in names if n in self.replaced}
