"""Training data: document sources, a held-out split, per-worker shards, packing into sequences.

Sharding needs no rank. Each worker walks the training documents in its own order, a
permutation drawn from a key (``data.shard_seed``, by default the worker's name), so workers
that never talked to each other still read different parts of the data. With an explicit
``data.rank``/``data.world_size`` the documents are split into disjoint slices instead.

The held-out eval documents are chosen by a hash of each document's identity (a file's
relative path, or the text itself): the same split on every worker, with no list to ship.

The reading position is a few integers (epoch, next document, and for each lane of
``PackedStream`` its document and token offset), so a checkpoint restores it exactly. A streamed
Hugging Face dataset adds a bookmark per document (``HFCorpus``): the dataset's own state, so that
resuming reads one block of documents again rather than all those before.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
import os
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..extras import install_hint
from .config import DataConfig


def stable_int(key: str) -> int:
    """A 64-bit integer from a string, the same on every machine and Python run."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little")


def is_held_out(key: str, fraction: float) -> bool:
    return fraction > 0 and stable_int("eval:" + key) / 2**64 < fraction


# -- sources --------------------------------------------------------------------------------

class Corpus(ABC):
    """Documents to train on, in an order that depends on the worker, and documents to evaluate on."""

    @abstractmethod
    def documents(self, epoch: int, start: int = 0, bookmark: str | None = None) -> Iterator[str]:
        """This worker's training documents for ``epoch``, from the ``start``-th on (found from
        ``bookmark``, where the source gives them, instead of by reading the ones before)."""

    def fetch_at(self, epoch: int, bookmark: str) -> str:
        """The training document a bookmark points at (sources with bookmarks only)."""
        raise NotImplementedError

    @abstractmethod
    def eval_documents(self) -> Iterator[str]:
        """Held-out documents, in the same fixed order on every worker."""

    def fetch(self, epoch: int, indices: list[int]) -> dict[int, str]:
        """Training documents by their index in ``epoch``'s order (to restore a reading position)."""
        want, out = set(indices), {}
        first = min(want)
        for i, text in enumerate(self.documents(epoch, first), start=first):
            if i in want:
                out[i] = text
                if len(out) == len(want):
                    break
        return out


class ListCorpus(Corpus):
    """A finite, indexable collection: ``items`` are (identity key, loader) pairs."""

    def __init__(self, items: list[tuple[str, Callable[[], str]]], *, eval_fraction: float, order_key: str,
                 rank: int | None = None, world_size: int | None = None, seed: int = 0):
        items = sorted(items, key=lambda kv: kv[0])
        held_out = [is_held_out(key, eval_fraction) for key, _ in items]
        self.train_keys = [key for (key, _), h in zip(items, held_out) if not h]
        self.eval_keys = [key for (key, _), h in zip(items, held_out) if h]
        self.train = [load for (_, load), h in zip(items, held_out) if not h]
        self.eval = [load for (_, load), h in zip(items, held_out) if h]
        if not self.train:
            raise ValueError("the corpus has no training documents")
        if rank is not None:
            self.indices = np.arange(rank, len(self.train), world_size)  # disjoint slices
            self.order_seed = stable_int(f"rank-order:{seed}:{rank}")
        else:
            self.indices = np.arange(len(self.train))
            self.order_seed = stable_int(f"order:{order_key}")
        if len(self.indices) == 0:
            raise ValueError(f"data shard {rank} of {world_size} is empty ({len(self.train)} documents)")

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.order_seed, epoch]).permutation(self.indices)

    def documents(self, epoch, start=0, bookmark=None):
        for i in self.order(epoch)[start:]:
            yield self.train[int(i)]()

    def fetch(self, epoch, indices):
        order = self.order(epoch)
        return {i: self.train[int(order[i])]() for i in indices}

    def eval_documents(self):
        for load in self.eval:
            yield load()


def _read(path: Path) -> Callable[[], str]:
    return lambda: path.read_text(encoding="utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[tuple[str, Path], ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            if name.endswith(".py") and path.is_file() and path.stat().st_size > 0:
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise RuntimeError(f"found no Python sources under {root} for the default corpus")
    return tuple(sorted(found))


def stdlib_items() -> list[tuple[str, Callable[[], str]]]:
    """The standard library's own ``*.py`` sources: tens of MB of real text on every Python install."""
    return [(key, _read(path)) for key, path in _stdlib_files()]


def file_items(paths: list[str]) -> list[tuple[str, Callable[[], str]]]:
    """Documents of local files: .jsonl lines (their ``text`` field) or .txt paragraphs."""
    items = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError):
                        raise ValueError(f"{path}:{n}: expected a JSON object with a 'text' field") from None
                    items.append((text, _const(str(text))))
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            for para in text.split("\n\n"):
                if para.strip():
                    items.append((para, _const(para + "\n\n")))
    if not items:
        raise ValueError(f"no documents in {paths}")
    return items


def _const(text: str) -> Callable[[], str]:
    return lambda: text


SHUFFLE_BLOCK = 1000
"""A streamed dataset is shuffled in blocks of this many documents (and by the order of its files)."""


class HFCorpus(Corpus):
    """A Hugging Face dataset, streamed: nothing is downloaded ahead of time.

    The training documents of an epoch are the dataset's shards (its files) in an order drawn from
    the worker's key and the epoch, each read in blocks of ``SHUFFLE_BLOCK`` documents that are
    shuffled by the same seed. A document's *bookmark* (plain text, saved with a checkpoint) is the
    dataset's own ``state_dict()`` at the start of its block, with the shard's place in the order and
    the document's place in the block: a resumed stream reads one block again, not everything before.
    """

    def __init__(self, cfg: DataConfig, order_key: str):
        try:
            import datasets
        except ImportError:
            raise RuntimeError(f"data.source = 'hf' needs the datasets package: {install_hint('data')}") from None
        self.datasets = datasets
        self.cfg = cfg
        self.seed = stable_int(f"rank-order:{cfg.seed}") if cfg.rank is not None else stable_int(f"order:{order_key}")
        self.seed %= 2**32
        self._train = None
        self.blocks: dict[str, tuple[list[str], dict]] = {}
        """The last few blocks read (``_HFReader``), by epoch, shard, block and the state they start at."""

    def _stream(self, split: str):
        return self.datasets.load_dataset(self.cfg.dataset, self.cfg.dataset_config, split=split, streaming=True)

    def _texts(self, ds) -> Iterator[str]:
        field = self.cfg.text_field
        for row in ds:
            if field not in row:
                raise KeyError(f"dataset {self.cfg.dataset!r} has no field {field!r} (data.text_field)")
            yield row[field]

    def _train_texts(self, ds) -> Iterator[str]:
        texts = self._texts(ds)
        if self.cfg.eval_split is None:
            texts = (t for t in texts if not is_held_out(t, self.cfg.eval_fraction))
        return texts

    def shard_order(self, epoch: int) -> list[int]:
        """The places of this worker's shards, in ``epoch``'s order (one stream with data.rank)."""
        if self._train is None:
            ds = self._stream(self.cfg.split)
            if self.cfg.rank is not None:
                from datasets.distributed import split_dataset_by_node

                ds = split_dataset_by_node(ds, rank=self.cfg.rank, world_size=self.cfg.world_size)
            self._train = ds
        if self.cfg.rank is not None or self._train.num_shards <= 1:
            return [-1]
        return [int(i) for i in np.random.default_rng([self.seed, epoch]).permutation(self._train.num_shards)]

    def shard(self, index: int):
        """A fresh stream of one shard (``-1``: the whole stream), with a reading state of its own."""
        if index < 0:
            return copy.deepcopy(self._train)  # several readers at once (the lanes' documents when resuming)
        return self._train.shard(num_shards=self._train.num_shards, index=index)

    def documents(self, epoch, start=0, bookmark=None):
        reader = _HFReader(self, epoch, bookmark)
        if bookmark is None:
            for _ in range(start):  # no bookmark (an older checkpoint): read up to the start
                if next(reader, None) is None:
                    break
        return reader

    def fetch_at(self, epoch, bookmark):
        text = next(_HFReader(self, epoch, bookmark), None)
        if text is None:
            raise RuntimeError(f"dataset {self.cfg.dataset!r} has no document at a saved reading position "
                               "(did the dataset change?)")
        return text

    def eval_documents(self):
        if self.cfg.eval_split is not None:
            return self._texts(self._stream(self.cfg.eval_split))
        return (t for t in self._texts(self._stream(self.cfg.split)) if is_held_out(t, self.cfg.eval_fraction))


class _HFReader:
    """The training documents of one epoch of an ``HFCorpus``, from a bookmark on; ``last_bookmark`` is
    the bookmark of the document last returned, ``bookmark()`` that of the next one."""

    def __init__(self, corpus: HFCorpus, epoch: int, bookmark: str | None = None):
        self.corpus, self.epoch = corpus, epoch
        self.order = corpus.shard_order(epoch)
        at = json.loads(bookmark) if bookmark else {"shard": 0, "state": None, "block": 0, "at": 0}
        self.place, self.block_no = int(at["shard"]), int(at["block"])
        self.last_bookmark: str | None = None
        self._open(at["state"])
        self._read_block()
        self.at = min(int(at["at"]), len(self.block))

    def _open(self, state: dict | None) -> None:
        """Reading goes on at ``state`` of the current shard (None: its start); the stream itself is opened
        when a block is read from it."""
        self.ds, self.texts, self.next_state = None, None, state

    def _read_block(self) -> None:
        """The current block: the next ``SHUFFLE_BLOCK`` documents of the shard, in a seeded order. Readers
        resuming in the same block (the lanes' documents) read it once: the corpus keeps the last few."""
        self.state, self.at = self.next_state, 0
        if self.place >= len(self.order):
            self.block = []
            return
        key = json.dumps([self.epoch, self.place, self.block_no, self.state])
        known = self.corpus.blocks.get(key)
        if known is not None:
            self.block, self.next_state = known
            self.ds = self.texts = None  # the stream, if read on, is opened again after the block
            return
        if self.texts is None:
            self.ds = self.corpus.shard(self.order[self.place])
            if self.state is not None:
                self.ds.load_state_dict(self.state)
            self.texts = self.corpus._train_texts(self.ds)
        docs = list(itertools.islice(self.texts, SHUFFLE_BLOCK))
        order = np.random.default_rng([self.corpus.seed, self.epoch, self.place, self.block_no]).permutation(len(docs))
        self.block, self.next_state = [docs[i] for i in order], self.ds.state_dict()
        self.corpus.blocks[key] = (self.block, self.next_state)
        while len(self.corpus.blocks) > 4:
            self.corpus.blocks.pop(next(iter(self.corpus.blocks)))

    def bookmark(self) -> str:
        return json.dumps({"shard": self.place, "state": self.state, "block": self.block_no, "at": self.at})

    def __iter__(self):
        return self

    def __next__(self) -> str:
        while self.at >= len(self.block):
            if self.block:
                self.block_no += 1
            elif self.place < len(self.order):  # the shard is done: the next one
                self.place, self.block_no = self.place + 1, 0
                self._open(None)
            else:
                raise StopIteration
            self._read_block()
        self.last_bookmark = self.bookmark()
        self.at += 1
        return self.block[self.at - 1]


def make_streams(cfg: DataConfig, tokenizer, *, order_key: str, batch_size: int, eval_count: int):
    """The training stream (``next_batch``, ``skip``, ``state_dict``, ``load_state_dict``) and the fixed
    held-out batches of ``cfg``'s source."""
    if cfg.source == "tokens":
        from .token_shards import TokenShards, TokenStream

        seed = stable_int(f"rank-order:{cfg.seed}:{cfg.rank}") if cfg.rank is not None else stable_int(
            f"order:{order_key}")
        shards = TokenShards(cfg.paths, cfg.seq_len, vocab_size=tokenizer.vocab_size, order_seed=seed,
                             eval_paths=cfg.eval_paths, eval_fraction=cfg.eval_fraction, rank=cfg.rank,
                             world_size=cfg.world_size)
        return TokenStream(shards), shards.eval_batches(batch_size, eval_count)
    corpus = make_corpus(cfg, order_key=order_key)
    stream = PackedStream(corpus, tokenizer, cfg.seq_len, lanes=batch_size)
    return stream, eval_batches(corpus, tokenizer, cfg.seq_len, batch_size, eval_count)


def make_corpus(cfg: DataConfig, order_key: str) -> Corpus:
    if cfg.source == "hf":
        return HFCorpus(cfg, order_key)
    items = stdlib_items() if cfg.source == "stdlib" else file_items(cfg.paths)
    return ListCorpus(items, eval_fraction=cfg.eval_fraction, order_key=order_key,
                      rank=cfg.rank, world_size=cfg.world_size, seed=cfg.seed)


# -- packing --------------------------------------------------------------------------------

class PackedStream:
    """Cuts tokenized documents (each followed by EOS) into ``seq_len`` rows, reading ``lanes`` at a time.

    Each lane is a cursor in one document; row ``i`` comes from lane ``i % lanes``, and a lane
    that finishes its document takes the next one in this worker's order. With as many lanes
    as rows in a batch, every row of a batch comes from a different document: a long document
    (a stdlib file is ~150 rows of 128 bytes) would otherwise fill whole batches, and a model
    that sees one file for many steps in a row learns that file rather than the language.

    Not a generator on purpose: the position is plain state (epoch, next document, and each
    lane's document and offset) that ``state_dict`` captures between any two calls and
    ``load_state_dict`` restores exactly.
    """

    def __init__(self, corpus: Corpus, tokenizer, seq_len: int, lanes: int = 1):
        if lanes < 1:
            raise ValueError("lanes must be >= 1")
        self.corpus, self.tokenizer, self.seq_len = corpus, tokenizer, seq_len
        self.epoch, self.next_doc, self.turn = 0, 0, 0
        self.lanes = [_Lane() for _ in range(lanes)]
        self._docs: Iterator[str] | None = None
        self._next_bookmark: str | None = None

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "next_doc": self.next_doc, "turn": self.turn,
                 "lanes": [[lane.epoch, lane.doc, lane.pos] + ([lane.bookmark] if lane.bookmark else [])
                           for lane in self.lanes]}
        following = self._docs.bookmark() if hasattr(self._docs, "bookmark") else self._next_bookmark
        if following is not None:  # a streamed source: where the next document starts
            state["next_bookmark"] = following
        return state

    def load_state_dict(self, state: dict) -> None:
        if len(state["lanes"]) != len(self.lanes):
            raise ValueError(f"data position has {len(state['lanes'])} lanes, this stream {len(self.lanes)} "
                             "(train.batch_size changed?)")
        self.epoch, self.next_doc, self.turn = int(state["epoch"]), int(state["next_doc"]), int(state["turn"])
        self._docs, self._next_bookmark = None, state.get("next_bookmark")
        self.lanes = [_Lane(int(e), int(d), int(p), bookmark=b[0] if b else None) for e, d, p, *b in state["lanes"]]
        for lane in self.lanes:  # a streamed source's documents, found from their bookmarks
            if lane.doc >= 0 and lane.bookmark is not None:
                lane.tokens = self._encode(self.corpus.fetch_at(lane.epoch, lane.bookmark))
        for epoch in {lane.epoch for lane in self.lanes if lane.doc >= 0 and lane.tokens is None}:
            lanes = [lane for lane in self.lanes if lane.doc >= 0 and lane.epoch == epoch and lane.tokens is None]
            texts = self.corpus.fetch(epoch, [lane.doc for lane in lanes])
            for lane in lanes:
                lane.tokens = self._encode(texts[lane.doc])

    def _encode(self, text: str) -> np.ndarray:
        return np.append(self.tokenizer.encode(text), self.tokenizer.eos_id)

    def _open_next(self, lane: _Lane) -> None:
        """Gives ``lane`` the next document of the order, opening the next epoch when one runs out."""
        for _ in range(2):
            if self._docs is None:
                self._docs = self.corpus.documents(self.epoch, self.next_doc, bookmark=self._next_bookmark)
                self._next_bookmark = None
            text = next(self._docs, None)
            if text is not None:
                lane.epoch, lane.doc, lane.pos, lane.tokens = self.epoch, self.next_doc, 0, self._encode(text)
                lane.bookmark = getattr(self._docs, "last_bookmark", None)
                self.next_doc += 1
                return
            if self.next_doc == 0:
                break
            self.epoch, self.next_doc, self._docs = self.epoch + 1, 0, None
        raise RuntimeError("the data source yielded no documents")

    def _row(self, out: list | None) -> None:
        lane = self.lanes[self.turn]
        self.turn = (self.turn + 1) % len(self.lanes)
        need = self.seq_len
        while need > 0:
            if lane.tokens is None or lane.pos >= len(lane.tokens):
                self._open_next(lane)
            k = min(need, len(lane.tokens) - lane.pos)
            if out is not None:
                out.append(lane.tokens[lane.pos : lane.pos + k])
            lane.pos += k
            need -= k

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """The next ``batch_size`` rows as a ``[batch_size, seq_len]`` LongTensor."""
        parts: list[np.ndarray] = []
        for _ in range(batch_size):
            self._row(parts)
        return torch.from_numpy(np.concatenate(parts).reshape(batch_size, self.seq_len))

    def skip(self, rows: int) -> None:
        """Moves on by ``rows`` sequences without building them."""
        for _ in range(rows):
            self._row(None)


@dataclass
class _Lane:
    epoch: int = 0
    doc: int = -1
    """Index of this lane's document in the epoch's order; -1 before its first."""
    pos: int = 0
    tokens: np.ndarray | None = None
    bookmark: str | None = None
    """Where the lane's document starts in a streamed source (``Corpus.fetch_at``), or None."""


def eval_batches(corpus: Corpus, tokenizer, seq_len: int, batch_size: int, count: int,
                 pool_factor: int = 32) -> list[torch.Tensor]:
    """The fixed held-out batches (identical on every worker); fewer if the split is small.

    Rows are cut at evenly spaced offsets of the whole held-out text (up to ``pool_factor``
    times what the batches need), so that they sample every part of many documents rather
    than the openings of the first few (file headers are not typical text).
    """
    rows = batch_size * count
    if rows == 0:
        return []
    pool, have = [], 0
    for text in corpus.eval_documents():
        pool.append(np.append(tokenizer.encode(text), tokenizer.eos_id))
        have += len(pool[-1])
        if have >= pool_factor * rows * seq_len:
            break
    if have < seq_len:
        return []
    flat = np.concatenate(pool)
    rows = min(rows, len(flat) // seq_len)
    starts = np.linspace(0, len(flat) - seq_len, rows).astype(np.int64)
    table = torch.from_numpy(np.stack([flat[i : i + seq_len] for i in starts]))
    return [table[i : i + batch_size] for i in range(0, rows, batch_size)]
