"""The trained HF target in Hugging Face's own layout, loadable with `from_pretrained`.

Each pipeline stage of replica 0 writes its tensors, under the checkpoint's names, to its own shard
`model-<k+1:05d>-of-<P:05d>.safetensors`; once every stage has written (the caller's barrier), rank
0 writes `model.safetensors.index.json`, the source's config.json (torch_dtype set to what was
trained) and the tokenizer files. The directory is built under a temp name and renamed, so it is
either complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from spectrain_api.fsio import atomic_write
from spectrain_workloads.hf.source import INDEX, ModelDir, read_safetensors_header


def shard_name(stage: int, n_stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{n_stages:05d}.safetensors"


def staging_dir(out: Path) -> Path:
    return out.parent / f".tmp-{out.name}"


def write_shard(out: Path, stage: int, n_stages: int, tensors: dict[str, torch.Tensor]) -> None:
    """One stage's tensors into the staging directory (a stale shard of an interrupted run is replaced)."""
    from safetensors.torch import save_file

    tmp = staging_dir(out)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / shard_name(stage, n_stages)
    atomic_write(path, lambda p: save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(p),
                                           metadata={"format": "pt"}), durable=False)


def finish(out: Path, source: ModelDir, n_stages: int, tokenizer: object, dtype: torch.dtype) -> Path:
    """Index, config and tokenizer beside the shards, then the rename that publishes `out`."""
    tmp = staging_dir(out)
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(n_stages):
        name = shard_name(k, n_stages)
        for tensor, meta in read_safetensors_header(tmp / name).items():
            weight_map[tensor] = name
            a, b = meta["data_offsets"]
            total += b - a
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = dict(source.config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(tmp)   # type: ignore[attr-defined]
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out
