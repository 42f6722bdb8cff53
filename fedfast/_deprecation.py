"""fedfast's deprecation notices: :class:`FedfastDeprecationWarning`, a DeprecationWarning of its own, so that the
command line can show each one (Python's default filters hide DeprecationWarnings raised outside ``__main__``, which a
plug-in's code is) without showing every library's."""

import warnings


class FedfastDeprecationWarning(DeprecationWarning):
    """An old form fedfast still accepts for one release; the message names the form that replaces it."""


def deprecated(message: str, stacklevel: int = 2) -> None:
    """Warn that an old form is used (``stacklevel`` counted from the caller of this function)."""
    warnings.warn(message, FedfastDeprecationWarning, stacklevel=stacklevel + 1)


def show_once() -> None:
    """Show each fedfast deprecation notice once per message (the command line's setting)."""
    warnings.filterwarnings("once", category=FedfastDeprecationWarning)
