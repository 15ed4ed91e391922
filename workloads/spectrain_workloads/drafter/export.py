"""Drafter checkpoints (resume) and exports (deployable artifact), both atomic and versioned.

Checkpoint: `$RUN_DIR/drafter/rank-<r>/ckpt-<version>/` = model.safetensors + optimizer.pt +
state.json. Written to a hidden temp dir, fsynced, then renamed: a directory named ckpt-<v>
is complete, so after a SIGKILL the newest one is intact and resuming loads it (a damaged one,
e.g. from a full disk, is skipped for the one before). The newest `keep` are kept.

Export: `$EXPORT_DIR/v<version>/model.safetensors` + `config.json`, and `LATEST` naming the newest
version directory, replaced atomically after the directory is complete. Consumers call
`load_drafter(dir) -> (module, meta)` with the export root (follows LATEST) or a version dir.

Exports are safe to serve (what a team deploys must never go backwards or be corrupt):
- a version number is never reused, by any incarnation of the writer: `.versions` in the export
  root holds the high-water mark, raised (atomically, fsynced) before a version's directory is
  built, so a number survives pruning, a lost checkpoint and a crash mid-write; the next version
  is above it, every `v<N>` present and LATEST (`export_high_water`). A writer asking for a number at
  or below that mark is refused (`ExportRefused`): no `v<N>` is rewritten, LATEST only moves forward;
- weights that are not all finite are refused;
- config.json carries `sha256`: file (relative to the version directory) -> hex digest, for every
  file of the version but config.json itself (the serving layouts' too); `load_drafter` checks
  them and names the file that does not match.
Writers of one export root serialize on `.lock` (flock): a restarted sidecar whose predecessor is
still finishing cannot interleave with it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spectrain_api import rundir
from spectrain_api.errors import ConfigError
from spectrain_api.fsio import atomic_dir, atomic_write_text
from spectrain_api.names import EAGLE, EAGLE3, LM
from spectrain_workloads.drafter.models import EagleDrafter
from spectrain_workloads.model import ModelConfig, Transformer

FORMAT = "spectrain-drafter/1"
_CKPT = re.compile(r"^ckpt-(\d+)$")
_EXPORT = re.compile(r"^v(\d+)$")
HIGH_WATER = ".versions"          # the export root's version high-water mark (JSON)
LOCK = ".lock"


class ExportRefused(ValueError):
    """An export that would reuse a version, move LATEST backwards or ship non-finite weights; `cause`:
    one of names.EXPORT_REJECT_CAUSES (non_finite, version_reused)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def _save_tensors(module: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, str(path))


def _versions(root: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := pattern.match(p.name)) and p.is_dir()]
    return sorted(out)


def _prune(root: Path, pattern: re.Pattern[str], keep: int) -> None:
    for _, p in _versions(root, pattern)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def clean_temp(root: Path) -> None:
    """Remove half-written temp dirs a killed process left behind."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------- checkpoints

def checkpoint_root(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return rundir.drafter_checkpoints(run_dir, rank)


def save_checkpoint(root: Path, version: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], *, keep: int) -> Path:
    def fill(tmp: Path) -> None:
        _save_tensors(module, tmp / "model.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        _write_json(tmp / "state.json", {**state, "version": version, "format": FORMAT, "saved_at": time.time()})

    path = atomic_dir(root / f"ckpt-{version}", fill)
    _prune(root, _CKPT, keep)
    return path


def latest_checkpoint_version(root: Path) -> int | None:
    vs = _versions(root, _CKPT)
    return vs[-1][0] if vs else None


def load_checkpoint(root: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Load the newest loadable checkpoint into module/optimizer; its state.json, or None."""
    from safetensors.torch import load_file

    for version, path in reversed(_versions(root, _CKPT)):
        try:
            state = json.loads((path / "state.json").read_text())
            tensors = load_file(str(path / "model.safetensors"))
            opt_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
            module.load_state_dict(tensors, strict=True)
            optimizer.load_state_dict(opt_state)
        except Exception as exc:  # any damage (safetensors raises its own error type): older one
            print(f"drafter: checkpoint {path} is unreadable ({exc}); trying the previous one", flush=True)
            continue
        state["version"] = version
        return state
    return None


# ---------------------------------------------------------------- exports

def _latest_version(root: Path) -> int:
    try:
        m = _EXPORT.match((root / "LATEST").read_text().strip())
    except (FileNotFoundError, NotADirectoryError):
        return 0
    return int(m.group(1)) if m else 0


def _recorded_high_water(root: Path) -> int:
    try:
        return int(json.loads((root / HIGH_WATER).read_text())["high_water"])
    except FileNotFoundError:
        return 0
    except (ValueError, KeyError, TypeError):
        # a damaged mark (written atomically, so only by hand): the directories and LATEST still bound it
        print(f"drafter: {root / HIGH_WATER} is unreadable; using the versions present", flush=True)
        return 0


def export_high_water(export_dir: str | os.PathLike[str]) -> int:
    """The highest export version this root ever had: the recorded mark, every v<N> present (half-written
    ones too) and LATEST. 0 for a root never exported to."""
    root = Path(export_dir)
    if not root.is_dir():
        return 0
    present = [int(m.group(1)) for p in root.iterdir()
               if (m := _EXPORT.match(p.name) or re.match(r"^\.tmp-v(\d+)-\d+$", p.name))]
    return max([_recorded_high_water(root), _latest_version(root), *present])


def next_export_version(export_dir: str | os.PathLike[str]) -> int:
    return export_high_water(export_dir) + 1


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def gate_verdict(acceptance: float | None, latest: float | None, min_acceptance: float, *,
                 latest_exists: bool) -> tuple[str, str] | None:
    """(cause, reason) why a candidate must not become LATEST (the exporting rank's gate), or None.

    `acceptance`: the candidate's acceptance length on the held-back samples (None: not measured);
    `latest`: LATEST's, measured on the same samples in the same round; `latest_exists`: there is a
    LATEST to compare with. Both measured together, the comparison has no tolerance: a candidate below
    LATEST by any amount is rejected, so a run of slightly worse candidates cannot walk LATEST down (a
    tolerance of x per export compounds to x^n). `min_acceptance` > 0: an absolute floor. Unmeasured
    (no held-back samples yet, e.g. right after a restart): rejected while there is a LATEST or a floor
    to meet, since nothing shows it meets them; with neither (the first versions) the finite check
    alone decides."""
    if acceptance is None or (latest_exists and latest is None):
        if latest_exists or min_acceptance > 0:
            return "unmeasured", ("not measured on held-back samples against "
                                  + ("LATEST's acceptance" if latest_exists else f"minAcceptance {min_acceptance:g}"))
        return None
    if not math.isfinite(acceptance):
        return "non_finite", f"acceptance length {acceptance} is not finite"
    if acceptance < min_acceptance:
        return "below_floor", f"acceptance length {acceptance:.3f} < minAcceptance {min_acceptance:g}"
    if latest is not None and acceptance < latest:
        return "below_latest", (f"acceptance length {acceptance:.3f} < {latest:.3f}, LATEST's on the same "
                                "held-back samples")
    return None


def acceptance_stderr(per_depth: list[int], chains: int) -> float:
    """Standard error of the mean accepted length over `chains` chains, from verify.Acceptance's
    per_depth (chains whose first j+1 drafts were accepted): X = sum_j [X > j], X^2 = sum_j (2j+1) [X > j]."""
    if chains < 2:
        return 0.0
    mean = sum(per_depth) / chains
    square = sum((2 * j + 1) * n for j, n in enumerate(per_depth)) / chains
    return math.sqrt(max(square - mean * mean, 0.0) / (chains - 1))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _digests(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): _sha256(p) for p in sorted(d.rglob("*"))
            if p.is_file() and p.relative_to(d).as_posix() != "config.json"}


def export_drafter(export_dir: str | os.PathLike[str], version: int | None, module: nn.Module,
                   meta: dict[str, Any], *, keep: int = 3, verifier_path: str = "") -> Path:
    """Write v<version>/{model.safetensors, config.json} and point LATEST at it.

    An EAGLE-3 drafter of a Hugging Face target also gets its serving layouts, sglang/ and
    speculators/ (drafter.eagle3_export; `verifier_path`: the target the speculators config names).
    `version` None: the next free number. Raises ExportRefused (nothing written) for a version at or
    below the root's high-water mark or for weights that are not all finite."""
    root = Path(export_dir)
    eagle3 = getattr(module, "arch", None) == EAGLE3
    arch = EAGLE3 if eagle3 else EAGLE if isinstance(module, EagleDrafter) else LM
    if eagle3:   # its own config is a LlamaConfig; model_config stays the target's (the worker's meta)
        cfg = ModelConfig(**meta["target_model_config"])
    else:
        cfg = module.cfg  # type: ignore[assignment]
    # checked on the host copy that is written: no kernels on the device the target trains on
    tensors = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    bad = nonfinite_tensors(tensors)
    if bad:
        raise ExportRefused(f"weights not finite: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}",
                            "non_finite")
    with _locked(root):
        high = export_high_water(root)
        version = high + 1 if version is None else version
        if version <= high:
            raise ExportRefused(f"version {version} is not above {root}'s high-water mark v{high}: "
                                "a version is never rewritten and LATEST never moves backwards", "version_reused")
        atomic_write_text(root / HIGH_WATER, json.dumps({"high_water": version}) + "\n")   # reserved first
        config = {**meta, "format": FORMAT, "arch": arch, "version": version, "model_config": cfg.to_dict(),
                  "vocab_size": cfg.vocab_size, "exported_at": time.time()}
        hf_target = getattr(module, "hf_target_config", None) if eagle3 else getattr(module, "target_config", None)
        if hf_target is not None:   # an HF target's drafter (hf_eagle / eagle3): its config.json
            config["hf_target_config"] = hf_target
        if eagle3:
            config["eagle3"] = {"feature_layers": list(module.feature_layers),      # type: ignore[attr-defined]
                                "draft_vocab_size": int(module.draft_vocab_size),  # type: ignore[attr-defined]
                                "layer_config": module.cfg.to_dict()}              # type: ignore[union-attr]

        def fill(tmp: Path) -> None:
            from safetensors.torch import save_file

            save_file(tensors, str(tmp / "model.safetensors"))
            if hf_target is not None and eagle3:   # beside it, the layouts vLLM and SGLang load (docs/serving.md)
                from spectrain_workloads.drafter.eagle3_export import export_eagle3

                export_eagle3(tmp, module, target_config=hf_target, target_path=verifier_path)  # type: ignore[arg-type]
            elif hf_target is not None:
                from spectrain_workloads.drafter.serving_export import export_serving

                export_serving(tmp, module)   # type: ignore[arg-type]
            _write_json(tmp / "config.json", {**config, "sha256": _digests(tmp)})

        path = atomic_dir(root / f"v{version}", fill)
        atomic_write_text(root / "LATEST", path.name + "\n")
        _prune(root, _EXPORT, keep)
    return path


def latest_export_meta(export_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """config.json of the version LATEST names, or None (no export yet, or it is unreadable)."""
    root = Path(export_dir)
    try:
        return json.loads((root / (root / "LATEST").read_text().strip() / "config.json").read_text())
    except (OSError, ValueError):
        return None


def resolve_export(path: str | os.PathLike[str]) -> Path:
    """An export root (with LATEST) or a version directory -> the version directory."""
    p = Path(path)
    if (p / "LATEST").is_file():
        return p / (p / "LATEST").read_text().strip()
    if (p / "config.json").is_file():
        return p
    raise ConfigError(f"{p} holds no drafter export: expected LATEST or config.json "
                      "(point at $SPECTRAIN_EXPORT_DIR or one of its v<N> directories)")


def load_drafter(path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """(module in eval mode, the export's config.json) from an export root or version directory.

    Eagle: `EagleDrafter` with the target's frozen embedding/head inside; LM: `model.Transformer`.
    Every file config.json lists is checked against its sha256 first (ConfigError naming the file).
    """
    from safetensors.torch import load

    d = resolve_export(path)
    meta = json.loads((d / "config.json").read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{d}/config.json has format {meta.get('format')!r}; this loader reads {FORMAT!r}")
    verify_export(d, meta, skip=("model.safetensors",))   # that one is checked as it is read, below
    known = set(ModelConfig.__dataclass_fields__)
    cfg = ModelConfig(**{k: v for k, v in meta["model_config"].items() if k in known})
    module: nn.Module
    if meta["arch"] == EAGLE and "hf_target_config" in meta:
        from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter  # imports transformers

        module = HFEagleDrafter(meta["hf_target_config"])
    elif meta["arch"] == EAGLE:
        module = EagleDrafter(cfg)
    elif meta["arch"] == LM:
        module = Transformer(cfg)
    else:
        raise ConfigError(f"{d}/config.json: unknown arch {meta['arch']!r}")
    module.load_state_dict(load(verified_bytes(d, meta, "model.safetensors")), strict=True)
    return module.to(device).eval(), meta


def verify_export(d: Path, meta: dict[str, Any], *, skip: tuple[str, ...] = ()) -> None:
    """Check every file config.json lists (but `skip`) against its sha256: ConfigError naming the first
    that differs."""
    digests = meta.get("sha256")
    if not isinstance(digests, dict):
        raise ConfigError(f"{d}/config.json has no sha256 of its files: the export predates checksums or was "
                          "edited; export the drafter again")
    for name, want in digests.items():
        if name not in skip and _sha256(d / name) != want:
            raise ConfigError(_mismatch(d, name))


def _mismatch(d: Path, name: str) -> str:
    return (f"{d / name} does not match the sha256 in {d}/config.json: the file is damaged or was replaced; "
            "use another version or export again")


def verified_bytes(d: Path, meta: dict[str, Any], name: str) -> bytes:
    """The bytes of `name` in version directory d, checked against config.json's sha256 (read once:
    what is checked is what is loaded)."""
    digests = meta.get("sha256")
    if not isinstance(digests, dict) or name not in digests:
        raise ConfigError(f"{d}/config.json has no sha256 of {name}: the export predates checksums or was "
                          "edited; export the drafter again")
    data = (d / name).read_bytes()
    if hashlib.sha256(data).hexdigest() != digests[name]:
        raise ConfigError(_mismatch(d, name))
    return data
