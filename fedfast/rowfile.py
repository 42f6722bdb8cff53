"""Moved to :mod:`fedfast.store.rowfile` (issue 61: the store's file format lives in the store's package). This
address works for one release with a :class:`fedfast._deprecation.FedfastDeprecationWarning`."""

from ._deprecation import deprecated
from .store import rowfile as _home


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(_home, name)
    deprecated(
        f"fedfast.rowfile.{name} moved to fedfast.store.rowfile.{name}; the old address goes in the next release"
    )
    return value
