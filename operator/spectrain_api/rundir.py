"""The run directory's split between the target and the drafter, defined once ($SPECTRAIN_RUN_DIR,
the pods' `run` volume; docs/contracts.md has the whole layout).

The drafter writes only under `drafter/` (DRAFTER_DIR): its checkpoints, its activity log, its
summary and, by default (spec.drafter.export.path "drafter"), its exports. In a cluster that
directory is the only part of the run volume the drafter container mounts read-write (plus an
export path of its own elsewhere on the volume, `export_subpath`), so a drafter, which handles bytes
from its peers, cannot touch the target's checkpoints, progress or metrics. Everything else is the
target's. Writers (the drafter) and readers (report, `spectrain run`'s status, the operator's local
progress view, bench/) take these paths from here. Torch-free, no file system access.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

DRAFTER_DIR = "drafter"
# The target's entries at the top of the run dir (docs/contracts.md): an export path on the run
# volume may name none of them.
TARGET_ENTRIES = ("target", "metrics", "progress.json", "tokenizer.json")
_RANKED = re.compile(r"-rank-(\d+)\.[a-z]+$")

PathLike = str | os.PathLike[str]


def target_hf(run_dir: PathLike) -> Path:
    """`target/hf/`: an HF target's trained model in Hugging Face's layout (the EAGLE-3 exports'
    verifier)."""
    return Path(run_dir) / "target" / "hf"


def drafter_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / DRAFTER_DIR


def drafter_checkpoints(run_dir: PathLike, rank: int) -> Path:
    """`drafter/rank-<r>/`: rank r's checkpoints (ckpt-<version>/)."""
    return drafter_dir(run_dir) / f"rank-{rank}"


def drafter_metrics(run_dir: PathLike, rank: int) -> Path:
    """`drafter/metrics-rank-<r>.jsonl`: rank r's activity log (work, acceptance, setup events)."""
    return drafter_dir(run_dir) / f"metrics-rank-{rank}.jsonl"


def drafter_summary(run_dir: PathLike, rank: int) -> Path:
    """`drafter/summary-rank-<r>.json`: rank r's latest summary (the status path's file)."""
    return drafter_dir(run_dir) / f"summary-rank-{rank}.json"


def _by_rank(run_dir: PathLike, pattern: str) -> list[tuple[int, Path]]:
    d = drafter_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.glob(pattern) if (m := _RANKED.search(p.name))]
    return sorted(found)


def drafter_metrics_files(run_dir: PathLike) -> list[tuple[int, Path]]:
    """(rank, path) of every drafter activity log in the run dir, by rank."""
    return _by_rank(run_dir, "metrics-rank-*.jsonl")


def drafter_summaries(run_dir: PathLike) -> list[tuple[int, Path]]:
    """(rank, path) of every drafter summary in the run dir, by rank."""
    return _by_rank(run_dir, "summary-rank-*.json")


def normalized(rel_path: str) -> str:
    """A relative path without '.' segments ('.' for the root itself)."""
    return posixpath.normpath(rel_path)


def in_drafter_dir(rel_path: str) -> bool:
    """Whether a run-dir-relative path is DRAFTER_DIR or under it."""
    p = normalized(rel_path)
    return p == DRAFTER_DIR or p.startswith(DRAFTER_DIR + "/")


def export_subpath(claim_name: str, export_path: str) -> str | None:
    """The part of the run volume the drafter needs read-write beside DRAFTER_DIR for its exports:
    spec.drafter.export.path, normalized, when the export goes to the run volume (no claim) outside
    DRAFTER_DIR; else None."""
    if claim_name or in_drafter_dir(export_path):
        return None
    return normalized(export_path)


def export_path_errors(claim_name: str, export_path: str) -> list[str]:
    """spec.drafter.export.path on the run volume must be a directory of the drafter's own: not the
    volume's root and none of the target's entries (the CRD's pattern already refuses absolute paths
    and '..')."""
    if claim_name:
        return []
    p = normalized(export_path)
    if p == "." or p.split("/", 1)[0] in TARGET_ENTRIES:
        return [f"spec.drafter.export.path: {export_path!r} on the run volume (no spec.drafter.export.claimName) "
                f"would let the drafter write {'the whole volume' if p == '.' else 'the target files'}; the drafter "
                f"may write only a directory of its own there: use the default {DRAFTER_DIR!r} (or a path under it, "
                f"or another directory not named {', '.join(TARGET_ENTRIES)}), or set spec.drafter.export.claimName"]
    return []
