"""Live progress of a local run: one line per rank (step, loss, tokens/s, drafter state).

Reads only what the workloads already write to the run directory (metrics/target-rank-<r>.jsonl,
drafter/summary-rank-<r>.json (spectrain_api.rundir), progress.json), following each JSON-lines
file by offset so a refresh costs a few small reads.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from spectrain_api import rundir


class JsonlTail:
    """Follows a JSON-lines file; `latest` is the newest complete record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.latest: dict[str, Any] | None = None

    def poll(self) -> dict[str, Any] | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.latest
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()          # an incomplete last line waits for the next poll
        for line in lines:
            if line.strip():
                try:
                    self.latest = json.loads(line)
                except json.JSONDecodeError:
                    continue
        return self.latest


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _bar(frac: float, width: int = 20) -> str:
    n = int(round(max(0.0, min(1.0, frac)) * width))
    return "#" * n + "." * (width - n)


class ProgressView:
    """Redraws one line per rank in place on a terminal; prints a line every 10 s otherwise."""

    def __init__(self, run_dir: Path, *, live: bool = True, out: TextIO | None = None,
                 every_s: float = 10.0) -> None:
        self.run_dir = run_dir
        self.live = live
        self.out = out or sys.stdout
        self.every_s = every_s
        self.tails: dict[int, JsonlTail] = {}
        self.drawn = 0
        self.last_print = 0.0

    def _ranks(self) -> list[int]:
        metrics = self.run_dir / "metrics"
        if metrics.is_dir():
            for p in metrics.glob("target-rank-*.jsonl"):
                r = int(p.stem.rsplit("-", 1)[1])
                self.tails.setdefault(r, JsonlTail(p))
        return sorted(self.tails)

    def lines(self) -> list[str]:
        total = (_read_json(self.run_dir / "progress.json") or {}).get("totalSteps")
        out = []
        for r in self._ranks():
            rec = self.tails[r].poll() or {}
            step = rec.get("step", 0)
            frac = step / total if total else 0.0
            loss = rec.get("loss")
            tps = rec.get("tokens_per_s")
            d = _read_json(rundir.drafter_summary(self.run_dir, r)) or {}
            drafter = d.get("state", "-")
            if d.get("acceptanceLength") is not None:
                drafter += f" acc {d['acceptanceLength']:.2f}"
            parts = [f"rank {r} [{_bar(frac)}] step {step}/{total or '?'}"]
            parts.append(f"loss {loss:.3f}" if isinstance(loss, (int, float)) else "loss -")
            if isinstance(tps, (int, float)):
                parts.append(f"tok/s {tps:.0f}")
            parts.append(f"drafter {drafter}")
            out.append(" ".join(parts))
        return out

    def refresh(self) -> None:
        now = time.monotonic()
        if not self.live and now - self.last_print < self.every_s:
            return
        self.last_print = now
        lines = self.lines()
        if not lines:
            return
        if self.live:
            if self.drawn:
                self.out.write(f"\x1b[{self.drawn}F")   # back to the first line we drew
            for line in lines:
                self.out.write("\x1b[2K" + line + "\n")
            self.drawn = len(lines)
        else:
            self.out.write(" | ".join(lines) + "\n")
        self.out.flush()

    def close(self) -> None:
        self.live = False
        self.last_print = 0.0
        self.refresh()
