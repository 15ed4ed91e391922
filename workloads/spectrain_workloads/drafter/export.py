"""Drafter checkpoints (resume) and exports (deployable artifact), both atomic and versioned.

Checkpoint: `$RUN_DIR/drafter/rank-<r>/ckpt-<version>/` = model.safetensors + optimizer.pt +
state.json. Written to a hidden temp dir, fsynced, then renamed: a directory named ckpt-<v>
is complete, so after a SIGKILL the newest one is intact and resuming loads it (a damaged one,
e.g. from a full disk, is skipped for the one before). The newest `keep` are kept.

Export: `$EXPORT_DIR/v<version>/model.safetensors` + `config.json`, and `LATEST` naming the newest
version directory, replaced atomically after the directory is complete. Consumers call
`load_drafter(dir) -> (module, meta)` with the export root (follows LATEST) or a version dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spectrain_workloads.drafter.models import EagleDrafter
from spectrain_workloads.errors import ConfigError
from spectrain_workloads.model import ModelConfig, Transformer

FORMAT = "spectrain-drafter/1"
_CKPT = re.compile(r"^ckpt-(\d+)$")
_EXPORT = re.compile(r"^v(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_dir():
            _fsync_tree(f)
            continue
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def _save_tensors(module: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, str(path))


def _atomic_dir(final: Path, fill: Any) -> Path:
    """Build `final` through a temp sibling and a rename; `fill(tmp_dir)` writes the files."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    fill(tmp)
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)   # a version can only be rewritten by the process that owns the rank
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


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
    return Path(run_dir) / "drafter" / f"rank-{rank}"


def save_checkpoint(root: Path, version: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], *, keep: int) -> Path:
    def fill(tmp: Path) -> None:
        _save_tensors(module, tmp / "model.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        _write_json(tmp / "state.json", {**state, "version": version, "format": FORMAT, "saved_at": time.time()})

    path = _atomic_dir(root / f"ckpt-{version}", fill)
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

def export_drafter(export_dir: str | os.PathLike[str], version: int, module: nn.Module,
                   meta: dict[str, Any], *, keep: int = 3) -> Path:
    """Write v<version>/{model.safetensors, config.json} and point LATEST at it."""
    root = Path(export_dir)
    arch = "Eagle" if isinstance(module, EagleDrafter) else "LM"
    cfg: ModelConfig = module.cfg  # type: ignore[assignment]
    config = {**meta, "format": FORMAT, "arch": arch, "version": version, "model_config": cfg.to_dict(),
              "vocab_size": cfg.vocab_size, "exported_at": time.time()}
    if hasattr(module, "target_config"):   # hf_eagle.HFEagleDrafter: rebuilt from the target's config.json
        config["hf_target_config"] = module.target_config

    def fill(tmp: Path) -> None:
        _save_tensors(module, tmp / "model.safetensors")
        _write_json(tmp / "config.json", config)
        if hasattr(module, "target_config"):   # beside it, the layouts vLLM and SGLang load (docs/serving.md)
            from spectrain_workloads.drafter.serving_export import export_serving

            export_serving(tmp, module)   # type: ignore[arg-type]

    path = _atomic_dir(root / f"v{version}", fill)
    latest_tmp = root / f".tmp-LATEST-{os.getpid()}"
    latest_tmp.write_text(path.name + "\n")
    os.replace(latest_tmp, root / "LATEST")
    _fsync_dir(root)
    _prune(root, _EXPORT, keep)
    return path


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
    """
    from safetensors.torch import load_file

    d = resolve_export(path)
    meta = json.loads((d / "config.json").read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{d}/config.json has format {meta.get('format')!r}; this loader reads {FORMAT!r}")
    known = set(ModelConfig.__dataclass_fields__)
    cfg = ModelConfig(**{k: v for k, v in meta["model_config"].items() if k in known})
    module: nn.Module
    if meta["arch"] == "Eagle" and "hf_target_config" in meta:
        from spectrain_workloads.drafter.hf_eagle import HFEagleDrafter  # imports transformers

        module = HFEagleDrafter(meta["hf_target_config"])
    elif meta["arch"] == "Eagle":
        module = EagleDrafter(cfg)
    elif meta["arch"] == "LM":
        module = Transformer(cfg)
    else:
        raise ConfigError(f"{d}/config.json: unknown arch {meta['arch']!r}")
    module.load_state_dict(load_file(str(d / "model.safetensors")), strict=True)
    return module.to(device).eval(), meta
