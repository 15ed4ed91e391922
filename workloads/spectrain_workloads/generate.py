"""`spectrain generate`: lossless speculative decoding with an HF target and an exported drafter.

    spectrain generate --model DIR --drafter DIR (--prompt TEXT | --prompts FILE)
        [--max-new-tokens N] [--temperature T] [--seed S] [--draft-tokens K] [--compare [--repeats R]]
        [--json] [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16]

The target is the model directory (a Hugging Face layout: the source of a job, or the trained
$RUN_DIR/target/hf); the drafter is an export root ($SPECTRAIN_EXPORT_DIR, follows LATEST) or one
of its v<N> directories, or an EAGLE-3 export (drafter/eagle3_export.py): its `speculators/`
directory or the root `export_eagle3` wrote holding it (not `sglang/`, which names no target and
feature layers on its own). An EAGLE-3 drafter borrows the target's embedding and is refused,
naming both sides, when its hidden size, vocabulary, feature layers (vs the target's layer count)
or architecture are another target's; the engine then has the target return the residual stream
before the drafter's feature layers at every position it verifies.

Decoding is the project's speculative-decoding engine (specdec: static KV caches, rejection-sampling
verification, the adaptive controller choosing 0..K drafted tokens per step from costs it measures
on this device: k = 0 where drafting does not pay), so the output distribution is the target's
own: at temperature 0 the tokens are the target's greedy tokens (transformers'
generate(do_sample=False)). Prompts are tokenized as transformers does
(`tokenizer(text).input_ids`, specials included). The output reports the controller's decisions:
`k_histogram` (decode steps per draft length) and `plain_share` (the share of steps decoded plainly).

--compare also decodes the same prompts without the drafter and reports the speedup fairly: after
the shown run and one plain warm-up run (first-call costs, the controller's learning), R pairs of
speculative and plain runs interleaved in ABBA order (drift on a busy machine cancels);
speedup_vs_plain is the median over pairs of plain time / speculative time per generated token,
with the pairs' spread (min, max).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from spectrain_api.errors import ConfigError
from spectrain_api.names import EAGLE

DTYPES = ("auto", "float32", "bfloat16")


def placement(device: str, dtype: str) -> tuple[Any, Any]:
    """(torch.device, torch.dtype): auto is CUDA when there is one; its dtype bf16 there, fp32 on the CPU."""
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {device!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this torch sees no CUDA device; use --device cpu")
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    return dev, dt or (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def load_target(model_dir: str) -> tuple[Any, Any, Any]:
    """(HFStage in eval mode, HFTokenizer, ModelDir) for a Hugging Face model directory."""
    from spectrain_workloads.hf.source import inspect
    from spectrain_workloads.hf.stage import HFStage
    from spectrain_workloads.hf.tokenizer import HFTokenizer

    uri = model_dir if "://" in model_dir else f"file://{Path(model_dir).resolve()}"
    source = inspect(uri)
    target = HFStage.stage(source, 0, 1)
    target.load_weights(source)
    return target.eval(), HFTokenizer(source.root, model_vocab=source.model_config.vocab_size), source


def load_matching_drafter(drafter_dir: str, source: Any, target: Any = None) -> tuple[Any, dict[str, Any]]:
    """The exported drafter, refused (naming both) when it was trained for another target. target:
    the loaded HFStage, whose embedding an EAGLE-3 drafter borrows (None: the export's copy)."""
    from spectrain_workloads.drafter.eagle3_export import find_eagle3, load_eagle3
    from spectrain_workloads.drafter.export import load_drafter

    try:
        if find_eagle3(drafter_dir) is not None:
            embedding = target.model.embed_tokens.weight if target is not None else None
            return load_eagle3(drafter_dir, target_config=source.config, embedding=embedding)
    except ConfigError as exc:
        raise ConfigError(f"--drafter {exc}") from exc
    module, meta = load_drafter(drafter_dir)
    want = source.model_config
    got = module.cfg
    # An Eagle drafter reads the target's hidden states (same width); an LM drafter only its tokens.
    shared = (("vocab size", "vocab_size"), ("hidden size", "dim")) if meta.get("arch") == EAGLE else \
        (("vocab size", "vocab_size"),)
    problems = [f"{name} {getattr(got, attr)} vs the target's {getattr(want, attr)}"
                for name, attr in shared if getattr(got, attr) != getattr(want, attr)]
    if problems:
        raise ConfigError(f"--drafter {drafter_dir}: trained for another model ({'; '.join(problems)}); export a "
                          f"drafter from a job on --model {source.root}")
    hf = meta.get("hf_target_config")
    if meta.get("arch") == EAGLE and hf is None:
        raise ConfigError(f"--drafter {drafter_dir}: an Eagle drafter of a preset target; an HF model needs the "
                          "drafter a job on that model exports")
    if hf is not None and hf.get("architectures") != source.config.get("architectures"):
        raise ConfigError(f"--drafter {drafter_dir}: trained for {hf.get('architectures')}, the target is "
                          f"{source.config.get('architectures')}")
    return module, meta


def _prompts(args: argparse.Namespace) -> list[str]:
    if (args.prompt is None) == (args.prompts is None):
        raise ConfigError("give exactly one of --prompt TEXT or --prompts FILE (one prompt per line)")
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = [ln.rstrip("\n") for ln in Path(args.prompts).read_text().splitlines()]
    except OSError as exc:
        raise ConfigError(f"--prompts {args.prompts}: {exc.strerror}") from exc
    prompts = [ln for ln in lines if ln.strip()]
    if not prompts:
        raise ConfigError(f"--prompts {args.prompts}: no non-empty line")
    return prompts


def compare(spec: Any, plain: Any, ids: list[list[int]], repeats: int) -> dict[str, Any]:
    """Interleaved timing of two warmed-up RolloutEngines on the same prompts (see the module doc)."""
    plain.generate(ids)                                           # warm-up; the speculative one was the shown run
    ratios = []
    for i in range(repeats):
        secs: dict[str, float] = {}
        for name in ("spec", "plain") if i % 2 == 0 else ("plain", "spec"):
            eng = spec if name == "spec" else plain
            t0 = time.perf_counter()
            res = eng.generate(ids)
            secs[name] = (time.perf_counter() - t0) / max(1, sum(len(r) for r in res.responses))   # per token
        ratios.append(secs["plain"] / secs["spec"])
    return {"speedup_vs_plain": statistics.median(ratios), "speedup_spread": [min(ratios), max(ratios)],
            "compare_pairs": len(ratios)}


def generate(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from spectrain_workloads.specdec.config import RolloutConfig
    from spectrain_workloads.specdec.engine import RolloutEngine

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    prompts = _prompts(args)
    device, dtype = placement(args.device, args.dtype)
    torch.manual_seed(args.seed)
    target, tok, source = load_target(args.model)
    target = target.to(device, dtype)               # first: an EAGLE-3 drafter borrows its embedding as placed
    drafter, _ = load_matching_drafter(args.drafter, source, target)
    drafter = drafter.to(device, dtype)
    ids = [list(tok.tok(p).input_ids) for p in prompts]
    if any(not p for p in ids):
        raise ConfigError("a prompt tokenizes to nothing; give at least one character")
    eos = source.config.get("eos_token_id", tok.EOS)
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        eos_id=eos[0] if isinstance(eos, list) else eos, speculative=True,
                        max_draft_tokens=args.draft_tokens, strategy="Bandit", batch_threshold=len(ids),
                        seed=args.seed)
    need = max(map(len, ids)) + cfg.max_new_tokens + cfg.max_draft_tokens + 2
    if need > source.model_config.max_seq_len:
        raise ConfigError(f"--max-new-tokens: prompt + {cfg.max_new_tokens} new + {cfg.max_draft_tokens} drafts "
                          f"+ 2 = {need} exceeds the model's max_position_embeddings "
                          f"{source.model_config.max_seq_len}; lower --max-new-tokens")
    engine = RolloutEngine(target, cfg, drafter)
    with torch.no_grad():
        t0 = time.perf_counter()
        res = engine.generate(ids)
        spec_s = time.perf_counter() - t0
        tokens = sum(len(r) for r in res.responses)
        out: dict[str, Any] = {
            "completions": [{"text": tok.decode(r), "token_ids": r} for r in res.responses],
            "acceptance_length": res.stats.acceptance_length,
            "tokens_per_s": tokens / spec_s,
            "k_histogram": {str(k): n for k, n in res.stats.k_histogram.items()},
            "plain_share": res.stats.plain_share,
        }
        if args.compare:
            plain = RolloutEngine(target, dataclasses.replace(cfg, speculative=False))
            out.update(compare(engine, plain, ids, args.repeats))
    return out


def main(args: argparse.Namespace) -> int:
    try:
        out = generate(args)
    except ConfigError as exc:
        print(f"spectrain generate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
        return 0
    for c in out["completions"]:
        print(c["text"])
        print("---")
    figures = {k: v for k, v in out.items() if k != "completions"}
    print("  ".join(f"{k} {_shown(v)}" for k, v in figures.items()))
    return 0


def _shown(v: Any) -> str:
    if isinstance(v, dict):
        return ",".join(f"{k}:{_shown(x)}" for k, x in v.items())
    if isinstance(v, list):
        return "-".join(_shown(x) for x in v)
    return f"{v:.3g}" if isinstance(v, float) else str(v)
