"""data: sources, the corpus and the deterministic, rank-sharded loader."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from spectrain_api.errors import ConfigError
from spectrain_workloads.data import LoaderSpec, TokenLoader, load_corpus, resolve_source

pytestmark = pytest.mark.unit


def test_loader_is_deterministic_sharded_resumable_and_skewable(tmp_path) -> None:
    corpus = load_corpus("builtin:python-stdlib", max_bytes=1 << 18)
    assert corpus.dtype == np.uint16 and corpus.size == 1 << 18
    specs = [LoaderSpec(seq_len=16, batch_size=4, data_parallel=2, replica=r, seed=3) for r in (0, 1)]
    a, b = TokenLoader(corpus, specs[0]), TokenLoader(corpus, specs[1])
    x0, y0 = a.batch(5)
    x1, _ = b.batch(5)
    assert x0.shape == (4, 16) and (x0[:, 1:] == y0[:, :-1]).all()
    assert not any((x0[i] == x1[j]).all() for i in range(4) for j in range(4))   # disjoint shards
    first = [next(a)[0] for _ in range(3)]
    resumed = TokenLoader(corpus, specs[0])
    resumed.load_state_dict({"step": 2})
    assert (next(resumed)[0] == first[2]).all() and a.state_dict() == {"step": 3}
    skewed = [TokenLoader(corpus, dataclasses.replace(s, skew=4.0)) for s in specs]
    assert [sk.batch(0)[0].shape[1] for sk in skewed] == [16, 8]    # step 0: replica 0 is the slow one
    assert [sk.batch(1)[0].shape[1] for sk in skewed] == [8, 16]


def test_data_sources(tmp_path, monkeypatch) -> None:
    (tmp_path / "claim" / "txt").mkdir(parents=True)
    (tmp_path / "claim" / "txt" / "a.txt").write_text("hello world\n" * 200)
    monkeypatch.setenv("SPECTRAIN_DATA_ROOT", str(tmp_path))
    assert load_corpus("pvc://claim/txt").size == 2400 + 1
    assert load_corpus(f"file://{tmp_path}/claim/txt/a.txt").size == 2401
    for bad, msg in [(f"file://{tmp_path}/nope", "does not exist"), ("builtin:wikipedia", "unknown builtin"),
                     ("s3://bucket/x", "use builtin"), ("file://relative/dir", "absolute")]:
        with pytest.raises(ConfigError, match=msg) as info:
            resolve_source(bad)
        assert "spec.target.data.source" in str(info.value)
