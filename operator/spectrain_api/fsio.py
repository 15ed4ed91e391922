"""Atomic file and directory writes: the one write-then-rename of the project.

A reader (the operator's status path, the drafter, a serving engine loading an export, a resumed
run) must never see half a file or half a directory: every write goes to a temp sibling in the
same directory (same filesystem, so the rename is atomic) and is renamed into place. `durable`
adds the fsyncs that make the new content survive a node crash (the file, then its directory):
checkpoints and exports need them; status files rewritten every second do not.

Temp names are `.tmp-<name>-<pid>`: hidden from listings that skip dot files, never shared by two
processes writing the same path, and recognisable as a killed writer's leftover (checkpoint and
export directories clean them up, and the export reserves versions by them).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f".tmp-{path.name}-{os.getpid()}")


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename into it). A directory that cannot be opened for
    reading (some network filesystems) is skipped: its filesystem orders renames itself."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then the directories bottom-up."""
    for p in path.iterdir():
        if p.is_dir():
            fsync_tree(p)
            continue
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(path)


def atomic_write(path: Path, write: Callable[[Path], Any], *, durable: bool = True) -> None:
    """`write(tmp)` writes the content to a temp sibling, which then replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, *, durable: bool = True) -> None:
    atomic_write(path, lambda p: p.write_text(text), durable=durable)


def atomic_write_json(path: Path, data: Any, *, durable: bool = True, **dumps: Any) -> None:
    atomic_write_text(path, json.dumps(data, **dumps), durable=durable)


def atomic_dir(final: Path, fill: Callable[[Path], Any], *, durable: bool = True) -> Path:
    """Build the directory `final` in a temp sibling (`fill(tmp)` writes its files) and rename it
    into place, replacing an existing `final` (only its owner writes it)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(final)
    shutil.rmtree(tmp, ignore_errors=True)      # left by an interrupted run of this pid number
    tmp.mkdir()
    try:
        fill(tmp)
        if durable:
            fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if durable:
        fsync_dir(final.parent)
    return final


__all__ = ["atomic_dir", "atomic_write", "atomic_write_json", "atomic_write_text", "fsync_dir", "fsync_tree"]
