"""What every wire format is: the ``Codec`` base class, and what a format says about itself.

A codec turns a flat fp32 CPU tensor into bytes and back (``encode``/``decode``, ``to_bytes``/``from_bytes``),
deterministically: the same tensor gives the same bytes on every machine, and the same bytes the same
tensor. Besides its bytes, a format states its own rules, so that nothing else has to know it by name:

- ``needs_error_feedback``: a round sends only some of the values and owes the rest to later rounds
  (the sparse formats: ``subsetN+``, ``topkN+``); ``error_feedback_pays``: coarse enough that error
  feedback is on by default (the 8- and 4-bit formats);
- ``rounding`` and ``view_dtype``: how far decoding may move a value, and the dtype a payload is
  viewed in, for the audit of a shard owner's result (``opendiloco.comm.audit``);
- ``start_round`` and ``sent``: what a round of a fragment sends (all of it, by default) and, afterwards,
  which of its values went out; what did not is owed to later rounds in the local weights
  (``DiLoCoOptimizer``); ``takes_buffers`` and ``allows_error_decay`` say which of the optimizer's
  options fit the format.

Formats are made from their names by ``opendiloco.comm.formats``, the one registry.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..errors import ProtocolError
from ..fingerprint import tensor_bytes

if TYPE_CHECKING:
    from .base import Communicator, RoundKey, Work


class Rounding(NamedTuple):
    """How far decoding may move a value: within ``relative`` x the largest magnitude of its block of
    ``block`` values, plus ``absolute``, of what was encoded (generous: rounding is half a step)."""

    block: int
    relative: float
    absolute: float


UNKNOWN_ROUNDING = Rounding(1 << 30, 1.0, 0.0)
"""A format that does not say: anywhere up to its largest magnitude."""


class Codec(ABC):
    """A wire format: its bytes, and its rules (see the module's docstring)."""

    name: str
    revision: int = 1
    """Bumped when a codec's bytes change under the same name: peers of different revisions never group."""
    needs_error_feedback: bool = False
    """A round sends only some of the values and owes the rest to later rounds: error feedback is required."""
    error_feedback_pays: bool = False
    """Coarse enough that error feedback is worth its two fp32 copies of the model: on by default."""
    takes_buffers: bool = True
    """The averages are of values (module buffers such as BatchNorm statistics may travel in it)."""
    allows_error_decay: bool = False
    """What a round does not send may be owed in a decayed residual instead (``error_decay``)."""
    subset = None
    """The shared-seed subset a round sends (``opendiloco.comm.subset.Subset``); None: no subset."""
    rounding: Rounding = UNKNOWN_ROUNDING
    """How far decoding may move a value (the audit's tolerance)."""
    view_dtype: torch.dtype = torch.float32
    """The dtype ``view_bytes`` gives: what an owner's Merkle leaves hash and audit answers carry."""

    @property
    def label(self) -> str:
        return self.name if self.revision == 1 else f"{self.name}.v{self.revision}"

    @property
    def values_label(self) -> str:
        """The label of the averages' format that a group label leaves unsaid (``codec_label``): this one's."""
        return self.label

    @property
    def averages(self) -> Codec:
        """The format the averages travel back in unless ``result_compression`` names one: this one
        (a sparse format's: its value format)."""
        return self

    def start_round(self, communicator: Communicator, flat: torch.Tensor, *, head: int, weight: float,
                    key: RoundKey, fragments: int, out: torch.Tensor, error_out: torch.Tensor | None) -> Work:
        """Starts a fragment's round of ``flat`` (``flat[:head]``: its pseudo-gradient, then its buffers'
        values) through ``communicator``: the whole of it. Waiting leaves the average in ``out`` and, with
        ``error_out``, what the wire lost of each value (a sparse format: of each value it sent)."""
        extra = {} if error_out is None else {"error_out": error_out}
        return communicator.start(flat, weight=weight, key=key, out=out, **extra)

    def sent(self, key: RoundKey, fragments: int, contribution: torch.Tensor,
             error: torch.Tensor) -> torch.Tensor | None:
        """The indices (ascending) of the values of a fragment's pseudo-gradient that its round ``key`` sent,
        from the ``contribution`` and the ``error`` the round left (both of the pseudo-gradient only);
        None: every value (a dense format)."""
        return None

    @abstractmethod
    def encode(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode a flat fp32 CPU tensor."""

    @abstractmethod
    def decode(self, encoded: dict[str, torch.Tensor], numel: int) -> torch.Tensor:
        """Decode back to a flat fp32 tensor of ``numel`` elements."""

    @abstractmethod
    def expected_fields(self, numel: int) -> dict[str, tuple[torch.dtype, int]]:
        """The fields ``encode`` produces for ``numel`` elements: name -> (dtype, element count).

        Used to validate what a peer sends before decoding it.
        """

    def roundtrip(self, flat: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(flat), flat.numel())

    def roundtrip_into(self, flat: torch.Tensor, out: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
        """``out[:] = roundtrip(flat)``, a cache-sized chunk at a time (no full-size wire copy).

        Chunks are multiples of every codec's block, so the values equal those of encoding
        ``flat`` in parts of the same size, as the round runner does.
        """
        for a in range(0, flat.numel(), chunk):
            self.decode_into(self.to_bytes(flat[a : a + chunk]), out[a : a + chunk])
        return out

    def wire_bytes(self, numel: int) -> int:
        return sum(torch.empty(0, dtype=dt).element_size() * n for dt, n in self.expected_fields(numel).values())

    def to_bytes_with_error(self, flat: torch.Tensor, error_out: torch.Tensor) -> memoryview | bytes:
        """``to_bytes``, and ``error_out[:] = flat - decoded payload``: what this encoding lost (error
        feedback adds it to the next contribution)."""
        payload = self.to_bytes(flat)
        self.decode_into(payload, error_out)
        torch.sub(flat, error_out, out=error_out)
        return payload

    def to_bytes(self, flat: torch.Tensor) -> memoryview | bytes:
        """``encode`` as one payload: the fields' bytes in name order (no copy for one-field codecs)."""
        fields = self.encode(flat)
        names = sorted(fields)
        if len(names) == 1:
            return tensor_bytes(fields[names[0]])
        return b"".join(tensor_bytes(fields[n]) for n in names)

    def from_bytes(self, payload: bytes, numel: int) -> torch.Tensor:
        """Decodes a payload made by ``to_bytes``; refuses one whose size does not fit ``numel``."""
        fields = self._fields(payload, numel)
        return self.decode(fields, numel) if numel else torch.zeros(0)

    def view_bytes(self, payload: bytes, numel: int) -> torch.Tensor:
        """The payload's values in a form ``torch.add`` accepts: no copy where the wire dtype is a float
        (fp16, fp32), decoded to fp32 otherwise. Same values as ``from_bytes``."""
        return self.from_bytes(payload, numel)

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        """Decodes a payload straight into the fp32 tensor ``out`` (one pass where the codec allows)."""
        out.copy_(self.view_bytes(payload, out.numel()))

    def _fields(self, payload: bytes, numel: int) -> dict[str, torch.Tensor]:
        expected = self.expected_fields(numel)
        sizes = {n: torch.empty(0, dtype=dt).element_size() * c for n, (dt, c) in expected.items()}
        if len(payload) != sum(sizes.values()):
            raise ProtocolError(f"payload of {len(payload)} bytes; {sum(sizes.values())} expected for {numel} values")
        fields, offset = {}, 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only bytes: decoding never writes to them
            for name in sorted(expected):
                dtype, count = expected[name]
                fields[name] = torch.frombuffer(payload, dtype=dtype, count=count, offset=offset) if count \
                    else torch.empty(0, dtype=dtype)
                offset += sizes[name]
        return fields


def codec_label(codec: Codec, result_codec: Codec | None = None) -> str:
    """How a group names its wire formats: ``int4``, ``int4/int8`` when averages travel wider,
    ``subset32+int4`` when a round sends a shared-seed subset."""
    label = codec.label
    if result_codec is None or result_codec is codec:
        return label
    if result_codec.averages is not result_codec:
        raise ValueError("the averages are of the contributions' values: their format takes no subsetN+ or topkN+ "
                         "prefix")
    if result_codec.label == codec.values_label:
        return label
    return f"{label}/{result_codec.label}"
