"""The tokenizer of a Hugging Face target (its tokenizer.json + tokenizer_config.json), loaded
offline with transformers, behind the small interface the corpus and `spectrain generate` use
(the byte tokenizer's: encode, decode, EOS/BOS, vocab_size)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from spectrain_api.errors import ConfigError


class HFTokenizer:
    kind = "hf"

    def __init__(self, root: str | os.PathLike[str], *, model_vocab: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            self.tok: Any = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        except Exception as exc:   # transformers raises OSError/ValueError/... for a broken directory
            raise ConfigError(f"spec.target.model.path: the tokenizer in {root} does not load ({exc}); save it "
                              "with tokenizer.save_pretrained(dir)") from exc
        if len(self.tok) > model_vocab:
            raise ConfigError(f"spec.target.model.path: the tokenizer in {root} has {len(self.tok)} tokens but "
                              f"config.json's vocab_size is {model_vocab}; they belong to different models")
        self.vocab_size = model_vocab
        self.EOS: int | None = self.tok.eos_token_id
        self.BOS: int | None = self.tok.bos_token_id
        self.dtype = np.uint16 if model_vocab <= 1 << 16 else np.uint32

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False))
        return ([self.BOS] if bos and self.BOS is not None else []) + ids + \
            ([self.EOS] if eos and self.EOS is not None else [])

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def encode_document(self, blob: bytes) -> np.ndarray:
        """One corpus file's token ids followed by EOS (the document separator)."""
        ids = self.encode(blob.decode("utf-8", errors="replace"), eos=True)
        return np.asarray(ids, dtype=self.dtype)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        self.tok.save_pretrained(str(directory))
        return Path(directory)
