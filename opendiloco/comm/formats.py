"""Every wire format by name: the one place a format's name is read.

A name is a dense format (``int4``: every value travels), or a sparse one: a prefix, N and a dense
format, ``PREFIXN+FORMAT`` (``subset32+int4``, ``topk64+e2m1``). ``get_codec`` makes the codec a name
stands for, and refuses any other name with a one-line ``ValueError`` that quotes it; the trainer's
config validates its names by calling it. What a format needs (error feedback, no module buffers...)
the codec says itself (``opendiloco.comm.codec``).

Adding a format: a module with its ``Codec`` subclass, and one line in ``CODECS`` (dense) or
``SPARSE`` (sparse: made from N and its dense value format, raising ``ValueError`` for an N it refuses).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from . import compression
from .codec import Codec
from .subset import SubsetCodec
from .topk import TopK

CODECS: dict[str, Callable[[], Codec]] = {
    "none": compression.NoCompression, "fp16": compression.Float16Compression,
    "scaled-fp16": compression.ScaledFloat16Compression,
    "int8": compression.int8, "int4": compression.int4, "e2m1": compression.e2m1, "e3m0": compression.e3m0,
}
"""The dense formats: name -> a callable that makes the codec."""


@dataclass(frozen=True)
class Sparse:
    """A sparse format: ``{prefix}N+FORMAT`` is ``make(N, the dense codec FORMAT)``."""

    prefix: str
    make: Callable[[int, Codec], Codec]
    example: str


SPARSE: tuple[Sparse, ...] = (
    Sparse("subset", SubsetCodec, "subset32+int4"),
    Sparse("topk", TopK, "topk64+e2m1"),
)
"""The sparse formats, by prefix."""

_SPARSE_NAME = re.compile(r"^([a-z]+?)([1-9][0-9]*)\+(.+)$")


def _sparse_of(name: str) -> Sparse | None:
    """The sparse format whose prefix ``name`` starts with (None: a dense name, or no format's)."""
    if name in CODECS:
        return None
    return next((s for s in SPARSE if name.startswith(s.prefix)), None)


def _choices() -> str:
    prefixes = " or ".join(f"{s.prefix}N+" for s in SPARSE)
    examples = ", ".join(s.example for s in SPARSE)
    return f"choose one of {', '.join(CODECS)}, or {prefixes} one of them (e.g. {examples})"


def get_codec(name: str, *, averages: bool = False) -> Codec:
    """The codec ``name`` stands for; ``ValueError`` (one line, quoting ``name``) for any other name.

    ``averages``: a name for the format the averages travel in, which is dense (they hold the
    members' values: a sparse name is refused)."""
    if not isinstance(name, str):
        raise ValueError(f"a format's name is a string, got {name!r}")
    sparse = _sparse_of(name)
    if sparse is None:
        if name not in CODECS:
            raise ValueError(f"unknown format {name!r}; {_choices()}")
        return CODECS[name]()
    if averages:
        raise ValueError(f"{name!r}: the averages are dense, of the contributions' values; name a format without "
                         f"{' or '.join(s.prefix + 'N+' for s in SPARSE)} (e.g. int8)")
    match = _SPARSE_NAME.match(name)
    if match is None or match.group(1) != sparse.prefix:
        raise ValueError(f"bad format {name!r}: a {sparse.prefix} format is {sparse.prefix}N+FORMAT, "
                         f"e.g. {sparse.example}")
    every, values = int(match.group(2)), match.group(3)
    if _sparse_of(values) is not None:
        raise ValueError(f"bad format {name!r}: sparse formats do not combine; {sparse.prefix}N+ takes one of "
                         f"{', '.join(CODECS)}")
    if values not in CODECS:
        raise ValueError(f"unknown format {name!r}; {_choices()}")
    try:
        return sparse.make(every, CODECS[values]())
    except ValueError as e:
        raise ValueError(f"bad format {name!r}: {e}") from None
