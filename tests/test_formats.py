"""The registry of wire format names (``opendiloco.comm.formats``): what each name makes, and a one-line
error quoting the name for every name it refuses; the config refuses the same names the same way."""

from __future__ import annotations

import re

import pytest

from opendiloco.comm.codec import Codec
from opendiloco.comm.compression import NoCompression, SmallFormat
from opendiloco.comm.formats import CODECS, SPARSE, get_codec
from opendiloco.comm.subset import Subset, SubsetCodec
from opendiloco.comm.topk import TopK
from opendiloco.train.config import SwarmConfig


@pytest.mark.parametrize("name, kind, label, needs_feedback, feedback_on", [
    ("none", NoCompression, "none", False, False),
    ("fp16", Codec, "fp16", False, False),
    ("scaled-fp16", Codec, "scaled-fp16", False, False),
    ("int8", SmallFormat, "int8.v2", False, True),
    ("int4", SmallFormat, "int4", False, True),
    ("e2m1", SmallFormat, "e2m1", False, True),
    ("e3m0", SmallFormat, "e3m0", False, True),
    ("subset32+int4", SubsetCodec, "subset32+int4", True, True),
    ("subset2+int8", SubsetCodec, "subset2+int8.v2", True, True),
    ("subset1024+none", SubsetCodec, "subset1024+none", True, True),
    ("topk64+e2m1", TopK, "topk64+e2m1.v3", True, True),
    ("topk2+int8", TopK, "topk2+int8.v2.v3", True, True),
    ("topk4096+fp16", TopK, "topk4096+fp16.v3", True, True),
])
def test_valid_names(name, kind, label, needs_feedback, feedback_on):
    codec = get_codec(name)
    assert isinstance(codec, kind) and codec.label == label
    assert codec.needs_error_feedback is needs_feedback
    assert SwarmConfig(compression=name).uses_error_feedback is feedback_on
    assert type(get_codec(codec.name)) is type(codec) and get_codec(codec.name).label == label  # the name remakes it


def test_a_format_says_what_the_optimizer_needs_to_know():
    subset, topk, dense = get_codec("subset8+int4"), get_codec("topk64+e2m1"), get_codec("int4")
    assert subset.subset == Subset(8) and subset.averages.label == "int4" and subset.takes_buffers
    assert topk.averages.label == "e2m1" and not topk.takes_buffers and topk.allows_error_decay
    assert dense.averages is dense and not dense.allows_error_decay and dense.subset is None
    assert subset.rounding == dense.rounding and subset.view_dtype == dense.view_dtype
    assert get_codec("fp16").view_dtype.itemsize == 2 and get_codec("none").rounding.block == 1


@pytest.mark.parametrize("name, says", [
    ("gzip", "unknown format 'gzip'; choose one of none, fp16"),
    ("", "unknown format ''"),
    ("INT4", "unknown format 'INT4'"),
    ("int4 ", "unknown format 'int4 '"),
    ("subset32+zip", "unknown format 'subset32+zip'"),
    ("topk64+nope", "unknown format 'topk64+nope'"),
    ("subset+int4", "bad format 'subset+int4': a subset format is subsetN+FORMAT, e.g. subset32+int4"),
    ("subset032+int4", "bad format 'subset032+int4'"),
    ("subset32", "bad format 'subset32'"),
    ("subset32int4", "bad format 'subset32int4'"),
    ("topk", "bad format 'topk': a topk format is topkN+FORMAT, e.g. topk64+e2m1"),
    ("topk-4+e2m1", "bad format 'topk-4+e2m1'"),
    ("subset1+int4", "bad format 'subset1+int4': a subset sends 1/N of the values, N from 2 to 1024; got 1"),
    ("subset4096+int8", "bad format 'subset4096+int8'"),
    ("topk3+e2m1", "bad format 'topk3+e2m1': N in topkN+ must divide 4096"),
    ("topk8192+e2m1", "bad format 'topk8192+e2m1': N in topkN+ must divide 4096"),
    ("subset8+topk64+e2m1", "bad format 'subset8+topk64+e2m1': sparse formats do not combine"),
    ("topk64+subset8+e2m1", "bad format 'topk64+subset8+e2m1': sparse formats do not combine"),
    ("subset32+subset2+int4", "bad format 'subset32+subset2+int4': sparse formats do not combine"),
])
def test_every_invalid_name_gives_a_one_line_error_that_quotes_it(name, says):
    with pytest.raises(ValueError) as e:
        get_codec(name)
    assert str(e.value).startswith(says) and len(str(e.value).splitlines()) == 1
    with pytest.raises(ValueError) as e:  # the config asks the registry: the same words
        SwarmConfig(compression=name)
    assert says in str(e.value)


@pytest.mark.parametrize("name", [s.example for s in SPARSE])
def test_the_averages_take_dense_names_only(name):
    assert get_codec("int8", averages=True).label == "int8.v2"
    with pytest.raises(ValueError, match=rf"^'{re.escape(name)}': the averages are dense"):
        get_codec(name, averages=True)


def test_names_that_are_not_strings_are_refused():
    for name in (None, 4, b"int4"):
        with pytest.raises(ValueError, match="a format's name is a string"):
            get_codec(name)


def test_every_sparse_prefix_names_no_dense_format_and_every_example_parses():
    for s in SPARSE:
        assert not any(dense.startswith(s.prefix) for dense in CODECS)
        assert get_codec(s.example).label.startswith(s.prefix)
