"""Tokenizers: UTF-8 bytes by default (nothing to download), any Hugging Face tokenizer by name."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Token ids 0..255 are the UTF-8 bytes of the text; 256.. are special tokens."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``transformers.AutoTokenizer`` (from the local cache or the Hub) behind the same interface."""

    def __init__(self, name: str):
        from ..extras import require

        transformers = require("transformers", "hf", f"data.tokenizer = {name!r}")
        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(name)
        except OSError as e:
            raise RuntimeError(f"could not load tokenizer {name!r} (data.tokenizer): {e}") from None
        if self.tok.eos_token_id is None:
            raise RuntimeError(f"tokenizer {name!r} has no end-of-sequence token")
        self.eos_id = int(self.tok.eos_token_id)
        self.bos_id = self.tok.bos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def make_tokenizer(name: str):
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Rounds the embedding table up so its matmuls hit fast GPU shapes."""
    return -(-vocab_size // multiple) * multiple


def special_ids(tokenizer) -> dict[str, int | None]:
    """A tokenizer's special token ids, as a ``transformers`` config names them."""
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
