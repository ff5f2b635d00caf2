"""Pre-tokenised token shards as a data source (``[data] source = "tokens"``): nanoGPT's uint16 ``.bin``
and ``.npy`` arrays, cut into rows, read in each worker's order, resumed exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opendiloco.train.config import ConfigError, load_config
from opendiloco.train.data import make_streams
from opendiloco.train.tokenizer import ByteTokenizer
from opendiloco.train.trainer import TrainError, train
from tests.test_train_loop import assert_resumes_bit_exactly

SEQ = 16


@pytest.fixture
def shards(tmp_path):
    """Two shards as nanoGPT's prepare.py writes them (a uint16 memmap) and as a .npy array; the token
    at each position of the whole stream is known."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 259, 50 * SEQ + 5), rng.integers(0, 259, 30 * SEQ + 9)
    out = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="w+", shape=(len(a),))
    out[:] = a
    out.flush()
    del out
    np.save(tmp_path / "more.npy", b.astype(np.int32))
    rows = np.concatenate([a[: 50 * SEQ].reshape(50, SEQ), b[: 30 * SEQ].reshape(30, SEQ)])
    return [str(tmp_path / "train.bin"), str(tmp_path / "more.npy")], rows


def _streams(paths, *args, batch=4, evals=2):
    cfg = load_config(None, ["--data.source", "tokens", "--data.paths", *paths, "--data.seq-len", str(SEQ), *args])
    return make_streams(cfg.data, ByteTokenizer(), order_key=cfg.shard_key, batch_size=batch, eval_count=evals)


def _row_ids(batch: torch.Tensor, rows: np.ndarray) -> list[int]:
    return [int(np.flatnonzero((rows == r.numpy()).all(axis=1))[0]) for r in batch]


def test_rows_are_the_shards_cut_in_seq_len_read_once_per_epoch_in_the_workers_order(shards):
    paths, rows = shards
    stream, evals = _streams(paths, "--data.eval-fraction", "0.1")
    held = {i for b in evals for i in _row_ids(b, rows)}
    assert 1 <= len(held) <= 8 and len(evals) == 2
    train_rows = len(stream.shards.train_rows)
    assert train_rows + len(stream.shards.eval_rows) == 80
    seen = [i for _ in range(train_rows) for i in _row_ids(stream.next_batch(1), rows)]
    assert sorted(seen) == sorted(int(i) for i in stream.shards.train_rows)  # every row, once, in an epoch
    assert not set(seen) & set(stream.shards.eval_rows.tolist())
    assert seen != sorted(seen)  # shuffled
    other, _ = _streams(paths, "--data.eval-fraction", "0.1", "--data.shard-seed", "other")
    theirs = [i for _ in range(train_rows) for i in _row_ids(other.next_batch(1), rows)]
    assert sorted(theirs) == sorted(seen) and theirs != seen  # another worker: the same rows, its own order
    ranks = [set(_streams(paths, "--data.rank", str(r), "--data.world-size", "2")[0].shards.train_rows.tolist())
             for r in range(2)]
    assert not ranks[0] & ranks[1]


def test_a_stream_resumed_from_its_state_reads_the_same_batches(shards):
    paths, _ = shards
    whole, _ = _streams(paths)
    expected = [whole.next_batch(4) for _ in range(50)]  # past the end of an epoch (78 rows)
    first, _ = _streams(paths)
    got = [first.next_batch(4) for _ in range(13)]
    state = first.state_dict()
    second, _ = _streams(paths)
    second.load_state_dict(state)
    got += [second.next_batch(4) for _ in range(37)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    skipped, _ = _streams(paths)
    skipped.skip(4 * 45)  # a joiner moves on by the rows it did not train
    assert torch.equal(skipped.next_batch(4), expected[45])


def test_eval_paths_are_the_held_out_rows(shards, tmp_path):
    paths, rows = shards
    stream, evals = _streams(paths[:1], "--data.eval-paths", paths[1])
    assert len(stream.shards.train_rows) == 50 and stream.shards.eval_rows is None
    assert all(i >= 50 for b in evals for i in _row_ids(b, rows))


@pytest.mark.slow
def test_training_on_token_shards_resumes_bit_exactly(shards, tmp_path):
    paths, _ = shards
    args = ["--model.hidden-size", "32", "--model.num-layers", "2", "--model.num-heads", "4",
            "--model.intermediate-size", "64", "--data.source", "tokens", "--data.paths", *paths,
            "--data.seq-len", str(SEQ), "--train.batch-size", "4", "--train.eval-batches", "2",
            "--train.threads", "1", "--optim.local-steps", "4", "--optim.warmup-steps", "2", "--run.progress",
            "false", "--run.worker", "w", "--train.total-steps", "24"]  # 96 rows: into the second epoch
    assert_resumes_bit_exactly(lambda run_dir: load_config(None, [*args, "--run.dir", str(run_dir)]), tmp_path, 10)


def test_a_token_beyond_the_vocabulary_later_in_a_shard_stops_training_in_one_line(tmp_path, monkeypatch):
    from opendiloco.train import token_shards

    monkeypatch.setattr(token_shards, "CHECKED_TOKENS", 8)  # opening the shard checks its first 8 tokens only
    tokens = np.ones(64 * SEQ, np.uint16)
    tokens[5 * SEQ] = 300
    tokens.tofile(tmp_path / "late.bin")
    cfg = load_config(None, ["--data.source", "tokens", "--data.paths", str(tmp_path / "late.bin"), "--data.seq-len",
                             str(SEQ), "--data.eval-fraction", "0", "--train.batch-size", "64", "--train.eval-batches",
                             "0", "--run.dir", str(tmp_path / "run"), "--run.progress", "false",
                             "--model.hidden-size", "32", "--model.num-layers", "1", "--model.num-heads", "4"])
    with pytest.raises(TrainError, match="data: a token shard: token id 300 is beyond") as e:
        train(cfg)
    assert "\n" not in str(e.value)


def test_bad_shards_are_one_line(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.save(tmp_path / "flat.npy", np.zeros((4, 4), np.int32))
    np.save(tmp_path / "big.npy", np.full(64, 70000, np.int64))
    for path, message in [("odd.bin", "its size is odd"), ("flat.npy", "expected a 1-D array"),
                          ("big.npy", "token id 70000 is beyond the tokenizer's vocabulary of 259"),
                          ("missing.bin", "token shard not found")]:
        cfg = load_config(None, ["--data.source", "tokens", "--data.paths", str(tmp_path / path),
                                 "--run.dir", str(tmp_path / "run"), "--run.progress", "false"])
        with pytest.raises(TrainError, match=message) as e:
            train(cfg)
        assert "\n" not in str(e.value)
    for args, message in [(["--data.paths", "a.txt"], r"data.paths: 'a.txt': expected a .bin or .npy file"),
                          ([], "source 'tokens' needs data.paths")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["--data.source", "tokens", *args])
