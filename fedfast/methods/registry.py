"""The method registry: ``register`` (a class decorator), ``unregister``, ``names`` and the tables they fill. Its own
module (issue 61) so that the method files import it from beside them, not from the package that imports them;
:mod:`fedfast.methods` re-exports every name (``from fedfast.methods import register`` is the public form)."""

from __future__ import annotations

import dataclasses
import sys

from .._registry import Registry
from .base import Method

REGISTRY = Registry("method", "algorithm")  # name -> Method subclass
BUILTIN = REGISTRY.builtin  # the methods fedfast ships (sealed below, after their imports)
REPLACED = REGISTRY.replaced  # name -> {"replaced": class (file), "by": class (file)}: replace=True


def register(name: str, *, replace: bool = False):
    """Class decorator: register a :class:`Method` subclass under ``name`` (lower-case, no ``+``).

    A name another class already holds (a built-in such as ``"fedavg"``, or another plug-in's) is refused with
    both classes and their files named: a run would otherwise report the new class's numbers under the old name.
    ``replace=True`` replaces it on purpose; runs of that name then record the replacement in ``config.json``
    (``replaced_methods``) and ``fedfast report`` marks their rows. Registering the same class from the same
    file (or a file of the same content) again is harmless (:class:`fedfast._registry.Registry`, which datasets,
    partitions and models share)."""
    if not isinstance(name, str) or not name or "+" in name or name != name.lower() or "." in name:
        raise ValueError(f"name: a lower-case method name without '+' or '.', got {name!r}")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise TypeError(f"register({name!r}): expected a fedfast.methods.Method subclass, got {cls!r}")
        if not dataclasses.is_dataclass(cls.Options):
            raise TypeError(f"{name}.Options: must be a dataclass")
        if "_registered_in" not in cls.__dict__:
            cls._registered_in = sys._getframe(1).f_code.co_filename  # where @register(...) was applied
        REGISTRY.add(name, cls, replace=replace)
        cls.name = name
        if "table" not in cls.__dict__ or not cls.__dict__["table"]:
            cls.table = name
        return cls

    return deco


def unregister(name: str) -> None:
    """Remove a plug-in's method (a built-in it replaced comes back); tests and notebooks that redefine one."""
    REGISTRY.remove(name)


def replaced(algorithm: str) -> dict:
    """``{name: {"replaced": ..., "by": ...}}`` for the registry names ``algorithm`` runs (``base+asd``: the
    base) that a plug-in replaced (``register(..., replace=True)``)."""
    return REGISTRY.replacements(algorithm[:-4] if algorithm.endswith("+asd") else algorithm)


def names(asd: bool = True) -> list[str]:
    """The registered method names, sorted (``asd``: then each ``base+asd`` the ASD add-on composes with)."""
    out = sorted(REGISTRY)
    if asd:
        out += [f"{n}+asd" for n in sorted(REGISTRY) if REGISTRY[n].accepts_asd]
    return out
