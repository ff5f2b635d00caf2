"""A streamed Hugging Face dataset resumes exactly, from bookmarks (the dataset's own ``state_dict``),
without reading again what came before: tested on a local dataset of parquet shards written here."""

from __future__ import annotations

import pytest
import torch

from opendiloco.train import data as data_mod
from opendiloco.train.config import load_config
from opendiloco.train.data import make_streams
from opendiloco.train.tokenizer import ByteTokenizer
from tests.test_train_loop import assert_resumes_bit_exactly

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def local_dataset(tmp_path_factory):
    """Three parquet shards of documents of varied lengths, as a Hugging Face dataset directory."""
    root = tmp_path_factory.mktemp("hf-dataset")
    for shard in range(3):
        texts = [f"shard {shard} document {i}: " + "lorem ipsum " * (1 + (7 * i + shard) % 4) for i in range(40)]
        datasets.Dataset.from_dict({"text": texts}).to_parquet(str(root / f"train-{shard:05d}.parquet"))
    return root


def _stream(root, *args):
    cfg = load_config(None, ["--data.source", "hf", "--data.dataset", str(root), "--data.seq-len", "32",
                             "--data.eval-fraction", "0.1", "--run.worker", "w", *args])
    return make_streams(cfg.data, ByteTokenizer(), order_key=cfg.shard_key, batch_size=4, eval_count=1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("split", [[], ["--data.rank", "1", "--data.world-size", "2"]], ids=["shards", "rank"])
def test_a_resumed_stream_reads_the_same_batches_and_not_what_came_before(local_dataset, monkeypatch, split):
    monkeypatch.setattr(data_mod, "SHUFFLE_BLOCK", 7)  # many blocks per shard
    read = []
    texts = data_mod.HFCorpus._texts

    def counted(self, ds):
        for text in texts(self, ds):
            read.append(text)
            yield text

    monkeypatch.setattr(data_mod.HFCorpus, "_texts", counted)
    whole = _stream(local_dataset, *split)
    expected = [whole.next_batch(4) for _ in range(120)]  # 1.2 to 2.5 epochs of the 108 (or 54) documents
    assert whole.epoch >= 1

    for stop in (1, 37, 90):  # inside the first shard, later in the first epoch, in the third
        first = _stream(local_dataset, *split)
        got = [first.next_batch(4) for _ in range(stop)]
        state = first.state_dict()
        assert "next_bookmark" in state and all(len(lane) == 4 for lane in state["lanes"])
        second = _stream(local_dataset, *split)
        read.clear()  # (building the stream read the held-out documents, for eval)
        second.load_state_dict(state)
        got.append(second.next_batch(4))
        # The lanes' documents and the next one, from their blocks, each block read once (the 4 lanes' and
        # the next document are in at most 3 blocks, of 7 training documents and the held-out ones among
        # them); never the documents before.
        print(f"stopped after batch {stop}: {len(read)} documents read to resume")
        assert len(read) <= 3 * 10
        got += [second.next_batch(4) for _ in range(119 - stop)]
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), stop


@pytest.mark.slow
def test_each_worker_reads_the_shards_in_its_own_order(local_dataset):
    firsts = {}
    for key in ("a", "b", "c", "d"):
        stream = _stream(local_dataset, "--data.shard-seed", key)
        stream.next_batch(4)
        firsts[key] = ByteTokenizer().decode(stream.lanes[0].tokens[:30])
    assert len(set(firsts.values())) > 1


@pytest.mark.slow
def test_training_on_a_streamed_dataset_resumes_bit_exactly(local_dataset, tmp_path):
    args = ["--model.hidden-size", "32", "--model.num-layers", "2", "--model.num-heads", "4",
            "--model.intermediate-size", "64", "--data.source", "hf", "--data.dataset", str(local_dataset),
            "--data.seq-len", "32", "--data.eval-fraction", "0.1", "--train.batch-size", "4",
            "--train.eval-batches", "2", "--train.threads", "1", "--optim.local-steps", "4",
            "--optim.warmup-steps", "2", "--run.progress", "false", "--run.worker", "w", "--train.total-steps", "16"]
    assert_resumes_bit_exactly(lambda run_dir: load_config(None, [*args, "--run.dir", str(run_dir)]), tmp_path, 7)
