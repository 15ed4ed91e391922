"""The benchmarks' shared statistics (bench/common.py)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.common import block_bootstrap_interval

pytestmark = pytest.mark.unit


def ratio(periods: list[tuple[bool, float]]) -> float:
    return statistics.median(t for f, t in periods if f) / statistics.median(t for f, t in periods if not f)


def interleaved(n: int, cost: float, seed: int) -> list[tuple[bool, float]]:
    """n steps in on-off-off-on blocks of 4, 10 % noise, a slow drift both share, on steps `cost` x slower."""
    rng = random.Random(seed)
    flags = [(i // 4) % 4 in (0, 3) for i in range(n)]
    return [(f, (1 + 0.3 * i / n) * (cost if f else 1.0) * rng.uniform(0.9, 1.1)) for i, f in enumerate(flags)]


def test_the_interval_holds_the_true_ratio_and_narrows_with_the_run() -> None:
    short, long = interleaved(200, 1.03, seed=1), interleaved(3000, 1.03, seed=1)
    lo_s, hi_s = block_bootstrap_interval(short, ratio, block=16)
    lo_l, hi_l = block_bootstrap_interval(long, ratio, block=16)
    assert lo_s < 1.03 < hi_s and lo_l < 1.03 < hi_l
    assert hi_l - lo_l < 0.5 * (hi_s - lo_s)
    assert lo_l > 1.0                       # a 3 % cost is told from none by a long run


def test_the_interval_is_seeded_and_too_short_a_run_gives_none() -> None:
    p = interleaved(400, 1.0, seed=2)
    assert block_bootstrap_interval(p, ratio, block=16) == block_bootstrap_interval(p, ratio, block=16)
    assert block_bootstrap_interval(p, ratio, block=16, seed=1) != block_bootstrap_interval(p, ratio, block=16)
    assert all(math.isnan(x) for x in block_bootstrap_interval(p[:20], ratio, block=16))


def test_bad_bootstrap_arguments_are_named() -> None:
    p = interleaved(64, 1.0, seed=3)
    for kwargs in ({"block": 0}, {"block": 16, "level": 1.0}, {"block": 16, "resamples": 1}):
        with pytest.raises(ValueError, match="block >= 1, level in \\(0, 1\\) and resamples >= 2"):
            block_bootstrap_interval(p, ratio, **kwargs)  # type: ignore[arg-type]
