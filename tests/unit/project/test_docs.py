"""The user docs stay references: docs/benchmarks.md fits a reader's sitting (under 400 lines, one
section per benchmark with its command and latest figures), and no tracked text carries the
project's own work-period labels (history belongs in git and the issues)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
# numbered labels of how the work went: a session, work period or stop followed by its number
PERIOD_LABEL = re.compile(r"\b(session|work period|period|stop)\s+#?\d+\b", re.IGNORECASE)


def test_benchmarks_md_is_a_reference_of_under_400_lines() -> None:
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) < 400
    benches = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_")
                     and "def main" in p.read_text())
    for name in benches:
        section = re.search(rf"^## bench-{re.escape(name)}\b.*?(?=^## |\Z)", text, re.M | re.S)
        assert section, f"docs/benchmarks.md has no section `## bench-{name}`"
        assert "**Run:**" in section[0] and "**Latest:**" in section[0], name


def test_no_tracked_text_names_a_work_period() -> None:
    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.yaml", "*.txt", "Makefile"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    hits = [f"{f}:{i + 1}: {line.strip()}" for f in files if (ROOT / f).is_file()
            for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines())
            if PERIOD_LABEL.search(line)]
    assert not hits, "\n".join(hits[:20])
