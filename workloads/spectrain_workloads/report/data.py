"""The run's files, read as the workloads wrote them (docs/contracts.md "Run directory layout").

Tolerant on purpose: a report is most wanted after a run that went wrong, so a missing file is an
empty list and a line cut by a kill mid-write is skipped, never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from spectrain_api import rundir


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue          # a line cut by a kill mid-write
    except FileNotFoundError:
        pass
    return out


def data_dir(run_dir: Path) -> Path:
    """The directory holding metrics/: the run dir itself, or the one a local run recorded."""
    if (run_dir / "metrics").is_dir():
        return run_dir
    layout = run_dir / "layout.json"
    if layout.exists():
        for d in json.loads(layout.read_text()).get("data_dirs", []):
            if (Path(d) / "metrics").is_dir():
                return Path(d)
    raise SystemExit(f"{run_dir}: no metrics/ found; pass the --run-dir of a `spectrain run` or a run volume")


def is_number(x: Any) -> TypeGuard[float]:
    """A JSON number (not a bool, not null): the logs write null for figures not measured yet."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rank_of(path: Path) -> int:
    return int(path.stem.rsplit("-", 1)[1])


@dataclass(kw_only=True)
class RankData:
    rank: int
    steps: list[dict[str, Any]] = field(default_factory=list)     # metrics/target-rank-<r>.jsonl
    windows: list[dict[str, Any]] = field(default_factory=list)   # metrics/windows-rank-<r>.jsonl
    drafter: list[dict[str, Any]] = field(default_factory=list)   # drafter/metrics-rank-<r>.jsonl
    summary: dict[str, Any] = field(default_factory=dict)         # drafter/summary-rank-<r>.json

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.drafter if e.get("event") == name]

    @property
    def has_drafter(self) -> bool:
        return bool(self.drafter or self.summary)


def load(run_dir: Path) -> dict[int, RankData]:
    d = data_dir(run_dir)
    ranks: dict[int, RankData] = {}

    def rank(p: Path, r: int | None = None) -> RankData:
        r = _rank_of(p) if r is None else r
        return ranks.setdefault(r, RankData(rank=r))

    for p in sorted((d / "metrics").glob("target-rank-*.jsonl")):
        rank(p).steps = read_jsonl(p)
    for p in sorted((d / "metrics").glob("windows-rank-*.jsonl")):
        rank(p).windows = read_jsonl(p)
    for r, p in rundir.drafter_metrics_files(d):
        rank(p, r).drafter = read_jsonl(p)
    for r, p in rundir.drafter_summaries(d):
        try:
            rank(p, r).summary = json.loads(p.read_text())
        except json.JSONDecodeError:
            pass
    return dict(sorted(ranks.items()))


__all__ = ["RankData", "data_dir", "is_number", "load", "read_jsonl"]
