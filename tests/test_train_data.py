"""The trainer's data pipeline: offline corpus, held-out split, sharding, packing, exact positions."""

import json

import numpy as np
import pytest
import torch

from opendiloco.train.config import DataConfig
from opendiloco.train.data import ListCorpus, PackedStream, eval_batches, file_items, make_corpus, stdlib_items
from opendiloco.train.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def stdlib():
    return stdlib_items()


def corpus(items, key="w", **kw):
    return ListCorpus(items, eval_fraction=kw.pop("eval_fraction", 0.05), order_key=key, **kw)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo wörld ✓' * 2  # ünïcode\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text  # specials are not bytes
    assert tok.vocab_size == 259


def test_default_corpus_is_the_stdlib_and_big_enough(stdlib):
    keys = [k for k, _ in stdlib]
    assert len(keys) > 200 and "os.py" in keys and not any("site-packages" in k for k in keys)
    c = corpus(stdlib)
    assert 0 < len(c.eval) < len(c.train)
    sample = [len(c.train[i]()) for i in range(0, len(c.train), max(1, len(c.train) // 50))]
    assert np.mean(sample) * len(c.train) > 5e6  # several MB of text


def test_eval_split_is_deterministic_and_disjoint(stdlib):
    a, b = corpus(stdlib, key="a"), corpus(stdlib, key="b")
    assert a.eval_keys == b.eval_keys and a.train_keys == b.train_keys  # the same split on every worker
    assert a.eval_keys and not set(a.train_keys) & set(a.eval_keys)
    assert len(a.train_keys) + len(a.eval_keys) == len(stdlib)
    assert [f() for f in a.eval] == [f() for f in b.eval]


def test_workers_read_different_parts_without_a_rank(stdlib):
    a1, a2, b = corpus(stdlib, key="worker-a"), corpus(stdlib, key="worker-a"), corpus(stdlib, key="worker-b")
    assert np.array_equal(a1.order(0), a2.order(0))  # deterministic
    assert not np.array_equal(a1.order(0)[:50], b.order(0)[:50])
    assert len(set(a1.order(0)[:50]) & set(b.order(0)[:50])) < 10
    assert not np.array_equal(a1.order(0), a1.order(1))  # a new order every epoch
    assert sorted(a1.order(0)) == list(range(len(a1.train)))


def test_explicit_ranks_are_disjoint_and_cover_everything(stdlib):
    shards = [corpus(stdlib, rank=r, world_size=3, seed=1) for r in range(3)]
    seen = [set(s.order(0).tolist()) for s in shards]
    assert not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])
    assert set().union(*seen) == set(range(len(shards[0].train)))


@pytest.mark.parametrize("lanes", [1, 8])
def test_packing_and_exact_resume(stdlib, lanes):
    tok = ByteTokenizer()
    s = PackedStream(corpus(stdlib), tok, seq_len=64, lanes=lanes)
    first = s.next_batch(4)
    assert first.shape == (4, 64) and first.dtype == torch.long
    for _ in range(20):
        s.next_batch(8)
    state = s.state_dict()
    expected = [s.next_batch(8) for _ in range(30)]

    again = PackedStream(corpus(stdlib), tok, seq_len=64, lanes=lanes)
    again.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(expected, [again.next_batch(8) for _ in range(30)]))

    skipper = PackedStream(corpus(stdlib), tok, seq_len=64, lanes=lanes)
    skipper.skip(4 + 20 * 8)
    assert torch.equal(skipper.next_batch(8), expected[0])


def test_lanes_put_different_documents_in_one_batch(stdlib):
    tok = ByteTokenizer()
    one, many = (PackedStream(corpus(stdlib), tok, seq_len=64, lanes=n) for n in (1, 8))
    for _ in range(3):
        one.next_batch(8)
        many.next_batch(8)
    assert len({lane.doc for lane in many.lanes}) == 8
    assert one.lanes[0].doc < 3  # one lane: three batches come from the first document or two
    assert many.next_doc < 16  # lanes take the worker's documents in order, none skipped


def test_documents_are_separated_by_eos_and_epochs_wrap(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("alpha alpha\n\nbeta beta beta\n\ngamma\n")
    tok = ByteTokenizer()
    c = ListCorpus(file_items([str(path)]), eval_fraction=0.0, order_key="k")
    s = PackedStream(c, tok, seq_len=16)
    rows = torch.cat([s.next_batch(1) for _ in range(12)]).flatten().tolist()
    assert rows.count(tok.eos_id) >= 6  # > one epoch of 3 documents
    assert s.epoch >= 1

    lanes = PackedStream(c, tok, seq_len=16, lanes=2)
    for _ in range(12):
        lanes.next_batch(2)
    restored = PackedStream(c, tok, seq_len=16, lanes=2)
    restored.load_state_dict(lanes.state_dict())  # lanes may hold documents of different epochs
    assert all(torch.equal(lanes.next_batch(2), restored.next_batch(2)) for _ in range(6))
    text = tok.decode(rows)
    assert "alpha alpha" in text and "beta beta beta" in text


def test_jsonl_files_and_bad_lines(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"document number {i}", "id": i}) for i in range(40)) + "\n")
    items = file_items([str(good)])
    assert len(items) == 40
    cfg = DataConfig(source="files", paths=[str(good)], eval_fraction=0.1)
    c = make_corpus(cfg, "w")
    assert len(c.train) + len(c.eval) == 40
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        file_items([str(bad)])


def test_eval_batches_are_fixed(stdlib):
    tok = ByteTokenizer()
    a = eval_batches(corpus(stdlib, key="a"), tok, 32, 4, 3)
    b = eval_batches(corpus(stdlib, key="b"), tok, 32, 4, 3)
    assert len(a) == 3 and all(x.shape == (4, 32) for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_hf_source_without_datasets_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(RuntimeError, match=r"pip install 'opendiloco-swarm\[data\]'"):
        make_corpus(DataConfig(source="hf", dataset="some/dataset"), "w")
