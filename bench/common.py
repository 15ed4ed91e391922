"""Shared benchmark plumbing: results JSON (BENCHMARKS.md keys + provenance) and a readable table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="same measurements, smaller sizes (< 60 s)")
    return ap.parse_args()


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "torch": None, "cuda_device": None}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_results(name: str, results: dict[str, Any], quick: bool) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = {**results, "quick": quick, "git_sha": git_sha(),
           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine()}
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return path


def print_table(title: str, rows: list[tuple[str, Any]] | dict[str, Any]) -> None:
    items = list(rows.items()) if isinstance(rows, dict) else rows
    width = max((len(k) for k, _ in items), default=10)
    print(f"\n{title}\n" + "-" * (width + 20))
    for key, value in items:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    idx = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[idx]


def block_bootstrap_interval(items: list[Any], statistic: Callable[[list[Any]], float], *, block: int,
                             level: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """`level` interval of `statistic(items)` over a run whose items come in an order with structure
    (interleaved on / off steps, drift on a shared machine): the run is cut into consecutive blocks of
    `block` items, which are drawn with replacement (seeded), so every resample keeps the interleaving
    pattern and the short-range correlation of neighbouring steps. A ratio whose interval straddles a
    goal is not shown met or missed by the run."""
    if block < 1 or not 0 < level < 1 or resamples < 2:
        raise ValueError(f"block_bootstrap_interval: block >= 1, level in (0, 1) and resamples >= 2, "
                         f"got block={block}, level={level}, resamples={resamples}")
    blocks = [items[i:i + block] for i in range(0, len(items) - block + 1, block)]
    if len(blocks) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    stats = sorted(statistic([x for _ in blocks for x in rng.choice(blocks)]) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return stats[int(tail * (resamples - 1))], stats[int((1.0 - tail) * (resamples - 1))]
