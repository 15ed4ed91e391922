"""Training text for the target: sources, corpus, and a deterministic rank-sharded loader.

Sources (spec.target.data.source, see docs/contracts.md):
- `builtin:python-stdlib`: the Python standard library sources of this interpreter
  (`sysconfig.get_paths()["stdlib"]`), real text that exists on every machine, offline;
- `file:///abs/dir` (or a single file);
- `pvc://<claim>/<path>`: `$SPECTRAIN_DATA_ROOT/<claim>/<path>` (default /var/run/spectrain/data).

The corpus is the byte-tokenized concatenation of the source's text files in sorted path order,
separated by EOS, capped at `max_bytes`. It is cut into non-overlapping windows of seq_len + 1
tokens; each epoch visits them in a seeded permutation. The batch of (step, replica) is a pure
function of (seed, step, replica), so resuming only needs the step counter and every pipeline
stage of a replica sees the same batch without talking to the others.

Skew injection (imbalance experiments): with `skew > 1`, at step n replica `n % data` keeps the
full seq_len and every other replica trains on the first `seq_len / skew` tokens of its windows,
so the fast replicas wait for the slow one at the gradient all-reduce.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spectrain_api import volumes
from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_DATA_ROOT
from spectrain_workloads.tokenizer import ByteTokenizer

SOURCE_FIELD = "spec.target.data.source"
DEFAULT_DATA_ROOT = "/var/run/spectrain/data"
MIN_CORPUS_TOKENS = 1024
_BINARY_PROBE = 4096   # bytes inspected for NUL to skip binary files


def volume_path(field: str, uri: str, *, data_root: str | None = None) -> Path:
    """The local path of file:///abs/dir or pvc://<claim>/<path> (claims mounted under
    $SPECTRAIN_DATA_ROOT); ConfigError naming `field` when it is malformed, missing or unreadable."""
    path = Path(volumes.parse(field, uri).local_path(data_root or os.environ.get(ENV_DATA_ROOT, DEFAULT_DATA_ROOT)))
    if not path.exists():
        raise ConfigError(f"{field} {uri!r}: {path} does not exist; check the path (and for pvc:// "
                          "that the claim is mounted under $SPECTRAIN_DATA_ROOT)")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{field} {uri!r}: {path} is not readable by this process")
    return path


def resolve_source(source: str, *, data_root: str | None = None) -> tuple[Path, str]:
    """(path, glob) for a source string; ConfigError naming the field for anything unusable."""
    if source == "builtin:python-stdlib":
        return Path(sysconfig.get_paths()["stdlib"]), "*.py"
    if source.startswith("builtin:"):
        raise ConfigError(f"{SOURCE_FIELD} {source!r}: unknown builtin dataset; the only builtin is "
                          "'builtin:python-stdlib'")
    if not source.startswith((volumes.FILE_SCHEME, volumes.PVC_SCHEME)):
        raise ConfigError(f"{SOURCE_FIELD} {source!r}: use builtin:python-stdlib, file:///abs/dir or "
                          "pvc://<claim>/<path>")
    return volume_path(SOURCE_FIELD, source, data_root=data_root), "*"


def _text_files(root: Path, pattern: str) -> Iterator[Path]:
    """Files under root in a fixed order (directories and names sorted), lazily: the corpus cap is
    usually reached long before a big tree (the stdlib) has been walked."""
    if root.is_file():
        yield root
        return
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if fnmatch.fnmatch(name, pattern):
                yield Path(dirpath) / name


def load_corpus(source: str, *, max_bytes: int = 8 << 20, data_root: str | None = None,
                tokenizer: Any = None) -> np.ndarray:
    """Token ids [N] of the source's text, files separated by EOS, from at most max_bytes bytes of text.

    `tokenizer`: None for the byte tokenizer (ids = bytes, uint16), or one with `encode_document(bytes)
    -> ids + EOS` (hf.tokenizer.HFTokenizer; uint16 or uint32 by vocabulary size)."""
    root, pattern = resolve_source(source, data_root=data_root)
    tok = ByteTokenizer()
    chunks: list[np.ndarray] = []
    total = 0
    sep = np.array([tok.EOS], dtype=np.uint16)
    for path in _text_files(root, pattern):
        try:
            blob = path.read_bytes()
        except OSError:
            continue   # one unreadable file in a big tree is not fatal; an empty corpus is (below)
        if not blob or b"\x00" in blob[:_BINARY_PROBE]:
            continue
        blob = blob[: max_bytes - total]
        if tokenizer is not None:
            chunks.append(tokenizer.encode_document(blob))
        else:
            # Byte tokenizer: ids are the bytes themselves, so skip the Python-level encode.
            chunks.append(np.frombuffer(blob, dtype=np.uint8).astype(np.uint16))
            chunks.append(sep)
        total += len(blob) + 1
        if total >= max_bytes:
            break
    corpus = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    if tokenizer is None:
        corpus = corpus[:max_bytes]
    if corpus.size < MIN_CORPUS_TOKENS:
        raise ConfigError(f"{SOURCE_FIELD} {source!r}: {root} holds {corpus.size} tokens of readable text; "
                          f"it needs at least {MIN_CORPUS_TOKENS}")
    return corpus


@dataclass(kw_only=True, frozen=True)
class LoaderSpec:
    seq_len: int
    batch_size: int          # sequences per replica per step (spec.target.data.batchSize)
    data_parallel: int = 1
    replica: int = 0
    seed: int = 0
    skew: float = 0.0        # 0 or 1: off; > 1: non-slow replicas train on seq_len / skew tokens

    def __post_init__(self) -> None:
        if self.seq_len < 8:
            raise ConfigError(f"spec.target.data.seqLen must be >= 8, got {self.seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"spec.target.data.batchSize must be >= 1, got {self.batch_size}")
        if not 0 <= self.replica < self.data_parallel:
            raise ConfigError(f"data-parallel replica {self.replica} outside 0..{self.data_parallel - 1}")
        if self.skew < 0:
            raise ConfigError(f"SPECTRAIN_DATA_SKEW must be >= 0 (0 = off), got {self.skew}")


class TokenLoader:
    """Batches of (inputs [B, T], targets [B, T]) int64 for one data-parallel replica.

    `batch(step)` is pure; iteration keeps a step counter that `state_dict()` saves.
    """

    def __init__(self, corpus: np.ndarray, spec: LoaderSpec) -> None:
        self.spec = spec
        self.corpus = corpus
        self.window = spec.seq_len + 1
        self.n_windows = (corpus.size - 1) // self.window
        if self.n_windows < spec.batch_size * spec.data_parallel:
            raise ConfigError(
                f"{SOURCE_FIELD}: the corpus holds {self.n_windows} windows of seqLen+1 = {self.window} tokens, "
                f"fewer than one global batch ({spec.batch_size} x {spec.data_parallel}); lower "
                "spec.target.data.seqLen/batchSize or use a bigger source")
        self.step = 0
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.spec.seed, epoch])
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def seq_len_at(self, step: int) -> int:
        """Tokens per sequence this replica trains on at `step` (seq_len unless skew shortens it)."""
        s = self.spec
        if s.skew <= 1 or s.data_parallel == 1 or step % s.data_parallel == s.replica:
            return s.seq_len
        return max(8, int(s.seq_len / s.skew))

    def batch(self, step: int) -> tuple[Any, Any]:
        import torch

        s = self.spec
        first = (step * s.data_parallel + s.replica) * s.batch_size   # global sample index
        idx = np.empty(s.batch_size, dtype=np.int64)
        for j in range(s.batch_size):
            g = first + j
            idx[j] = self._permutation(g // self.n_windows)[g % self.n_windows]
        starts = idx * self.window
        rows = self.corpus[starts[:, None] + np.arange(self.window)[None, :]].astype(np.int64)  # [B, T+1]
        t = self.seq_len_at(step)
        rows = torch.from_numpy(rows[:, : t + 1])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[Any, Any]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
