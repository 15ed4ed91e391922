"""Byte-level tokenizer: works offline on any text, needs no training, and is saved with the run.

ids 0..255 are bytes; PAD, BOS, EOS follow. vocab_size is padded to a multiple of 8 so the
embedding and LM head have friendly shapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from spectrain_api.errors import ConfigError
from spectrain_api.fsio import atomic_write_json
from spectrain_api.names import BYTE_VOCAB_SIZE


class ByteTokenizer:
    kind = "byte"
    PAD, BOS, EOS = 256, 257, 258
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8", errors="replace"))
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike[str]) -> Path:
        path = Path(directory) / "tokenizer.json"
        atomic_write_json(path, {"kind": self.kind, "vocab_size": self.vocab_size,
                                 "pad": self.PAD, "bos": self.BOS, "eos": self.EOS}, durable=False)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ByteTokenizer:
        path = Path(directory) / "tokenizer.json"
        meta = json.loads(path.read_text())
        if meta.get("kind") != cls.kind:
            raise ConfigError(f"{path}: tokenizer kind {meta.get('kind')!r} is not supported; expected 'byte'")
        return cls()
