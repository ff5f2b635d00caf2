"""Optional parts of the install: a feature whose package is missing says, in one line, which extra
to install. The import name is ``opendiloco``; the distribution is ``opendiloco-swarm`` (the package
index's ``opendiloco`` is another project)."""

from __future__ import annotations

import importlib
from types import ModuleType

DISTRIBUTION = "opendiloco-swarm"


class MissingExtra(RuntimeError, ImportError):
    """A feature needs a package of an extra that is not installed (the message is the user's one line).
    An ``ImportError`` too: an integration module whose framework is missing fails its import with it."""


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(module: str, extra: str, feature: str) -> ModuleType:
    """``module``, imported; :class:`MissingExtra` naming ``extra`` where it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or module.split(".")[0] != e.name.split(".")[0]:
            raise  # the package is there but something it imports is broken: that is not a missing extra
        raise MissingExtra(f"{feature} needs {e.name}, which is not installed: install the extra "
                           f"{extra!r} ({install_hint(extra)})") from None
