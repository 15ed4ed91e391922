"""rundir: every file the drafter writes in the run dir lies under drafter/, and no module spells
the drafter's file names but spectrain_api.rundir."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from spectrain_api import rundir

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_the_drafters_files_are_under_its_directory(tmp_path: Path) -> None:
    d = rundir.drafter_dir(tmp_path)
    for path in (rundir.drafter_checkpoints(tmp_path, 3), rundir.drafter_metrics(tmp_path, 3),
                 rundir.drafter_summary(tmp_path, 3)):
        assert path.parent == d and "3" in path.name
    assert d == tmp_path / rundir.DRAFTER_DIR


def test_files_are_listed_by_rank_in_numeric_order(tmp_path: Path) -> None:
    assert rundir.drafter_summaries(tmp_path) == [] and rundir.drafter_metrics_files(tmp_path) == []
    for r in (10, 2, 0):
        rundir.drafter_summary(tmp_path, r).parent.mkdir(parents=True, exist_ok=True)
        rundir.drafter_summary(tmp_path, r).write_text("{}")
        rundir.drafter_metrics(tmp_path, r).write_text("")
    (rundir.drafter_dir(tmp_path) / ".tmp-summary-rank-5.json-123").write_text("{}")   # a writer's temp file
    assert rundir.drafter_summaries(tmp_path) == [(r, rundir.drafter_summary(tmp_path, r)) for r in (0, 2, 10)]
    assert [r for r, _ in rundir.drafter_metrics_files(tmp_path)] == [0, 2, 10]


@pytest.mark.parametrize(("claim", "path", "subpath", "refused"), [
    ("", "drafter", None, False),
    ("", "drafter/exports", None, False),
    ("", "./drafter/./x", None, False),
    ("", "exports", "exports", False),
    ("", "a/./b", "a/b", False),
    ("", "drafters", "drafters", False),          # a prefix of drafter/ is not under it
    ("", ".", ".", True),
    ("", "target/x", "target/x", True),
    ("", "progress.json", "progress.json", True),
    ("models", ".", None, False),                 # its own claim: any relative path
    ("models", "target", None, False),
])
def test_export_paths(claim: str, path: str, subpath: str | None, refused: bool) -> None:
    assert rundir.export_subpath(claim, path) == subpath
    errors = rundir.export_path_errors(claim, path)
    assert bool(errors) == refused and all(e.startswith("spec.drafter.export.path:") for e in errors)


def test_no_other_module_spells_the_drafters_file_names() -> None:
    """A name built (f-string, glob) anywhere else, or the names before drafter/ (drafter-rank-<r>,
    drafter-summary-rank-<r>), would be a second definition of the layout."""
    files = subprocess.run(["git", "grep", "--untracked", "-l", "-E",
                            r"(summary|metrics)-rank-[{*]|drafter-summary-rank|drafter-rank-",
                            "--", "operator", "workloads", "bench", "scripts", "tests"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert files == ["operator/spectrain_api/rundir.py", "tests/unit/api/test_rundir.py"]
