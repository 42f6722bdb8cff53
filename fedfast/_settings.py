"""The settings a part of the engine reads, and no others: each part declares a frozen dataclass of
:class:`Settings` whose fields are :class:`fedfast.SimConfig`'s of the same names and types (a field typed as
another :class:`Settings` is that group, made from the same config), and is built with ``Part(PartSettings.of(config),
...)``. A part never holds the run's whole config, so what it depends on is read off its settings class, and a read
of anything else is an ``AttributeError`` in the first test that reaches it (tests/test_settings.py checks every
class's fields against SimConfig's)."""

from __future__ import annotations

import dataclasses
import typing


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Base of a part's settings (a frozen dataclass of SimConfig's fields)."""

    @classmethod
    def of(cls, config) -> typing.Self:
        """The settings read from ``config`` (a :class:`fedfast.SimConfig`, or anything with its fields)."""
        if isinstance(config, cls):
            return config
        hints = typing.get_type_hints(cls)
        kw = {}
        for f in dataclasses.fields(cls):
            group = hints[f.name]
            kw[f.name] = (
                group.of(config) if isinstance(group, type) and issubclass(group, Settings) else getattr(config, f.name)
            )
        return cls(**kw)

    @classmethod
    def given(cls, settings, argument: str = "settings") -> typing.Self:
        """``settings`` when it is a ``cls``, else a TypeError naming ``argument`` and the way to make one."""
        if not isinstance(settings, cls):
            raise TypeError(
                f"{argument}: expected a {cls.__module__}.{cls.__name__} (made with "
                f"{cls.__name__}.of(config)), got {type(settings).__name__}"
            )
        return settings
