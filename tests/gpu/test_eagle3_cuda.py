"""EAGLE-3 on CUDA in bf16, with a tiny random 7-layer transformers Llama built here (no hub).

- training: the TTT loss under bf16 autocast (fp32 weights, the optimizer's copy) falls over 150
  steps on the target's own greedy continuations, every loss finite;
- `spectrain generate --device cuda` (bf16) decodes with the trained drafter's export
  (`export_eagle3`'s speculators layout) and reports its figures; the share of greedy tokens equal to
  transformers' bf16 greedy is printed, not asserted (kernels for different query lengths may round a
  near-tie differently on the GPU), and so is the acceptance.
Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spectrain_workloads.hf.tiny import build_model

pytestmark = pytest.mark.gpu
os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[2]
LAYERS, VD, STEPS = 7, 256, 150


def test_eagle3_trains_under_bf16_autocast_and_generate_decodes_with_it(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spectrain_workloads.drafter.eagle3 import (
        build_eagle3,
        default_feature_layers,
        features_from_hidden_states,
        train_step,
    )
    from spectrain_workloads.drafter.eagle3_export import export_eagle3

    model_dir = build_model(tmp_path / "target", "LlamaForCausalLM", layers=LAYERS)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir)).cuda().eval()
    V = ref.config.vocab_size
    torch.manual_seed(0)
    with torch.no_grad():      # greedy continuations [256, 32] of random prompts, their features and logits
        ids = ref.generate(torch.randint(3, V, (256, 4), device="cuda"), max_new_tokens=28, min_new_tokens=28,
                           do_sample=False, pad_token_id=0)
        out = ref(ids, output_hidden_states=True)
    feats = features_from_hidden_states(out.hidden_states, default_feature_layers(LAYERS))   # [256, 32, 3H]
    counts = torch.bincount(out.logits.argmax(-1).flatten(), minlength=V)
    drafter = build_eagle3(ref, token_counts=counts, draft_vocab_size=VD, seed=0).cuda()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    for _ in range(STEPS):
        b = torch.randint(0, ids.size(0), (16,), generator=gen, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses.append(float(train_step(drafter, opt, feats[b], ids[b], out.logits[b]).loss))
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"eagle3 bf16 autocast: loss {first:.4g} -> {last:.4g} over {STEPS} steps")
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and last < 0.7 * first

    export_eagle3(tmp_path / "export", drafter.cpu().eval(), target_config=ref.config.to_dict(),
                  target_path=model_dir)
    prompt = "def main(argv):\n"
    res = subprocess.run([sys.executable, "-m", "spectrain_operator.cli", "generate", "--model", str(model_dir),
                          "--drafter", str(tmp_path / "export"), "--prompt", prompt, "--max-new-tokens", "32",
                          "--device", "cuda", "--dtype", "bfloat16", "--compare", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    got = result["completions"][0]["token_ids"]
    assert got and result["speedup_vs_plain"] > 0
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    bf16 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    x = torch.tensor([tok(prompt).input_ids], device="cuda")
    want = bf16.generate(x, max_new_tokens=32, do_sample=False)[0, x.size(1):].tolist()
    same = sum(a == b for a, b in zip(got, want, strict=False)) / max(len(want), 1)
    print(f"eagle3 bf16 generate: {json.dumps({k: v for k, v in result.items() if k != 'completions'})}, "
          f"greedy tokens equal to transformers' {same:.2f}")
