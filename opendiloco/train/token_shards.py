"""Pre-tokenised token shards as training data (``[data] source = "tokens"``).

A shard is a flat array of token ids: a ``.bin`` file of uint16 values, as nanoGPT's ``prepare.py``
writes them, or a ``.npy`` file of a 1-D integer array. They are memory-mapped, never read whole.
The shards, one after another, are cut into rows of ``seq_len`` tokens (a shard's last partial row
is left out); rows cross document boundaries, as nanoGPT's batches do (the tokenizer's end-of-text
tokens are in the shards).

Each worker reads the training rows in its own order, a permutation per epoch drawn from its key
(``data.shard_seed``, by default the worker's name), or a disjoint slice with ``data.rank`` and
``data.world_size``, like the text sources. The eval rows are the rows of ``data.eval_paths``, or
else a share ``data.eval_fraction`` of all rows chosen by a fixed seed (the same on every worker).

The reading position is two integers (epoch, next row), so a checkpoint resumes it exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import TrainError

CHECKED_TOKENS = 1 << 20
"""Token ids checked against the vocabulary when a shard is opened (its first ones: a shard written
by another tokenizer shows at once); every batch is checked as it is read."""


def open_tokens(path: str) -> np.ndarray:
    """A shard as a read-only 1-D array (memory-mapped); ``ValueError`` (one line) if it is not one."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"token shard not found: {p}")
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ValueError(f"{p}: a .bin shard holds uint16 token ids, but its size is odd")
        return np.memmap(p, dtype=np.uint16, mode="r") if p.stat().st_size else np.zeros(0, np.uint16)
    try:
        array = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"{p}: not a .npy array ({e})") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{p}: expected a 1-D array of integer token ids, got {array.ndim}-D {array.dtype}")
    return array


class TokenShards:
    """Rows of ``seq_len`` tokens from token shards: the training rows in this worker's order, and the
    held-out rows."""

    def __init__(self, paths: list[str], seq_len: int, *, vocab_size: int, order_seed: int,
                 eval_paths: list[str] = (), eval_fraction: float = 0.0, rank: int | None = None,
                 world_size: int | None = None):
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.shards = [open_tokens(p) for p in paths]
        self.names = list(paths)
        self.eval_shards = [open_tokens(p) for p in eval_paths]
        for name, array in zip([*paths, *eval_paths], [*self.shards, *self.eval_shards]):
            self._check(array[:CHECKED_TOKENS], name)
        self.starts = np.cumsum([0] + [len(a) // seq_len for a in self.shards])
        rows = int(self.starts[-1])
        if rows == 0:
            raise ValueError(f"the token shards hold no row of {seq_len} tokens (data.seq_len)")
        if eval_paths:
            self.eval_rows, train = None, np.arange(rows)
        else:
            held = np.random.default_rng(0x5EED).random(rows) < eval_fraction
            self.eval_rows, train = np.flatnonzero(held), np.flatnonzero(~held)
        if rank is not None:
            train = train[rank::world_size]
        if len(train) == 0:
            raise ValueError("no training rows in the token shards" +
                             (f" for data shard {rank} of {world_size}" if rank is not None else ""))
        self.train_rows, self.order_seed = train, order_seed
        self._order: tuple[int, np.ndarray] | None = None

    def _check(self, tokens: np.ndarray, name: str) -> None:
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"{name}: token id {int(tokens.max())} is beyond the tokenizer's vocabulary of "
                             f"{self.vocab_size} (data.tokenizer must be the one that wrote the shards)")

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.order_seed, epoch]).permutation(self.train_rows))
        return self._order[1]

    def row(self, index: int, shards: list[np.ndarray] | None = None, starts: np.ndarray | None = None) -> np.ndarray:
        shards = self.shards if shards is None else shards
        starts = self.starts if starts is None else starts
        shard = int(np.searchsorted(starts, index, side="right")) - 1
        begin = (index - int(starts[shard])) * self.seq_len
        return np.asarray(shards[shard][begin : begin + self.seq_len], dtype=np.int64)

    def eval_batches(self, batch_size: int, count: int) -> list[torch.Tensor]:
        """The fixed held-out batches (fewer if there are too few held-out rows), evenly spread over them."""
        if self.eval_rows is None:
            starts = np.cumsum([0] + [len(a) // self.seq_len for a in self.eval_shards])
            available, pick = int(starts[-1]), lambda i: self.row(i, self.eval_shards, starts)
        else:
            available, pick = len(self.eval_rows), lambda i: self.row(int(self.eval_rows[i]))
        rows = min(batch_size * count, available)
        if rows == 0:
            return []
        table = torch.from_numpy(np.stack([pick(int(i)) for i in np.linspace(0, available - 1, rows).astype(np.int64)]))
        return [table[i : i + batch_size] for i in range(0, rows, batch_size)]


class TokenStream:
    """The training rows of ``TokenShards``, ``batch_size`` at a time; the same interface as
    ``data.PackedStream`` (``next_batch``, ``skip``, ``state_dict``, ``load_state_dict``)."""

    def __init__(self, shards: TokenShards):
        self.shards = shards
        self.epoch, self.next_row = 0, 0

    def state_dict(self) -> dict:
        return {"kind": "tokens", "epoch": self.epoch, "next_row": self.next_row}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "tokens":
            raise ValueError("the data position is not one of token shards (data.source changed?)")
        self.epoch, self.next_row = int(state["epoch"]), int(state["next_row"])

    def _advance(self) -> int:
        order = self.shards.order(self.epoch)
        index = int(order[self.next_row])
        self.next_row += 1
        if self.next_row == len(order):
            self.epoch, self.next_row = self.epoch + 1, 0
        return index

    def next_batch(self, batch_size: int) -> torch.Tensor:
        rows = [self.shards.row(self._advance()) for _ in range(batch_size)]
        batch = np.stack(rows)
        try:
            self.shards._check(batch, "a token shard")
        except ValueError as e:  # mid-run: the trainer's error, one line for the user, not a traceback
            raise TrainError(f"data: {e}") from None
        return torch.from_numpy(batch)

    def skip(self, rows: int) -> None:
        total = len(self.shards.train_rows)
        position = self.next_row + rows
        self.epoch, self.next_row = self.epoch + position // total, position % total
