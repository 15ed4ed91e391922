"""fsio: a reader sees the old content or the new, never half; a failed write leaves the old
content and no temp file; and it is the project's one write-then-rename."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from spectrain_api.fsio import atomic_dir, atomic_write, atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parents[3]


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": 2}, durable=False, sort_keys=True)
    assert path.read_text() == '{"a": 2}'
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]


def test_a_failed_write_keeps_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")

    def half(p: Path) -> None:
        p.write_text("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_atomic_dir_replaces_a_directory_whole(tmp_path: Path) -> None:
    final = tmp_path / "v1"
    atomic_dir(final, lambda d: (d / "a").write_text("1"))
    atomic_dir(final, lambda d: (d / "b").write_text("2"))
    assert sorted(p.name for p in final.iterdir()) == ["b"]

    def broken(d: Path) -> None:
        (d / "c").write_text("3")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_dir(final, broken)
    assert sorted(p.name for p in final.iterdir()) == ["b"] and [p.name for p in tmp_path.iterdir()] == ["v1"]


# The ring publishes its file by its own protocol (a producer binds a private name, then renames);
# an HF export's stages write shards into one shared staging dir that the last stage renames.
OWN_PROTOCOL = {"workloads/spectrain_workloads/ring/handover.py", "workloads/spectrain_workloads/hf/save.py"}


def test_fsio_is_the_one_write_then_rename() -> None:
    files = subprocess.run(["git", "ls-files", "workloads/*.py", "operator/*.py"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    rename = re.compile(r"\bos\.(replace|rename)\(|\.rename\(")
    hits = [f"{f}:{i + 1}" for f in files if f not in OWN_PROTOCOL and not f.endswith("/fsio.py")
            and (ROOT / f).is_file()
            for i, line in enumerate((ROOT / f).read_text().splitlines()) if rename.search(line)]
    assert not hits, f"write-then-rename outside spectrain_api.fsio: {hits}"
