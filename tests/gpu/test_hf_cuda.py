"""Hugging Face targets on CUDA in bf16: a tiny random Llama built here with transformers.

- an HF stage in bf16 gives transformers' own bf16 logits (same layer code, same kernels), and its
  cached decode (static KV cache, boolean masks) stays within bf16 rounding of the full forward;
- `spectrain generate --device cuda` (bf16) runs the speculative engine with an exported drafter and
  reports its figures; the fraction of greedy tokens equal to transformers' bf16 greedy is printed,
  not asserted (kernels for different query lengths may round a near-tie differently on the GPU).
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


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama") / "m", "LlamaForCausalLM", layers=4)


def test_hf_stage_in_bf16_is_transformers_and_decodes_with_its_cache(llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    from spectrain_workloads.hf.source import inspect
    from spectrain_workloads.hf.stage import HFStage
    from spectrain_workloads.model import causal_decode_mask

    src = inspect(f"file://{llama}")
    stage = HFStage.stage(src, 0, 1)
    stage.load_weights(src)
    stage = stage.to("cuda", torch.bfloat16).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.bfloat16).cuda().eval()
    x = torch.randint(0, 400, (2, 48), device="cuda")
    with torch.no_grad():
        want = ref(x).logits
        full = stage(x)
        stage.setup_caches(2, 64)
        pos = torch.arange(40, device="cuda")
        a = stage(x[:, :40], pos, causal_decode_mask(pos, 64))
        pos = torch.arange(40, 48, device="cuda")
        b = stage(x[:, 40:], pos, causal_decode_mask(pos, 64))
    print(f"hf bf16: |stage - transformers| max {float((full - want).abs().max()):.3g}")
    assert torch.allclose(full.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(torch.cat([a, b], 1).float(), full.float(), atol=5e-2, rtol=5e-2)


def test_a_training_step_on_cuda_runs_under_bf16_autocast(llama: Path) -> None:
    """fp32 weights (the optimizer's copy), bf16 matmuls: the loss is within bf16 rounding of the fp32
    forward's, and the gradients are fp32 and finite."""
    import torch.nn.functional as F

    from spectrain_workloads.hf.source import inspect
    from spectrain_workloads.hf.stage import HFStage

    src = inspect(f"file://{llama}")
    stage = HFStage.stage(src, 0, 1)
    stage.load_weights(src)
    stage = stage.cuda()
    x = torch.randint(0, 400, (4, 64), device="cuda")
    loss = F.cross_entropy(stage(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    stage.amp = False
    with torch.no_grad():
        ref = F.cross_entropy(stage(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert abs(float(loss) - float(ref)) < 2e-2 * float(ref), (float(loss), float(ref))


def test_generate_on_cuda_in_bf16(llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spectrain_workloads.drafter.export import export_drafter
    from spectrain_workloads.drafter.hf_eagle import build_hf_eagle
    from spectrain_workloads.hf.source import inspect
    from spectrain_workloads.hf.stage import HFStage

    src = inspect(f"file://{llama}")
    target = HFStage.stage(src, 0, 1)
    target.load_weights(src)
    drafter = build_hf_eagle(src.config, target.model.embed_tokens.weight, target.lm_head.weight, seed=0)
    export_drafter(tmp_path / "export", 1, drafter, {})
    prompt = "def main(argv):\n"
    res = subprocess.run([sys.executable, "-m", "spectrain_operator.cli", "generate", "--model", str(llama),
                          "--drafter", str(tmp_path / "export"), "--prompt", prompt, "--max-new-tokens", "32",
                          "--device", "cuda", "--compare", "--json"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    got = out["completions"][0]["token_ids"]
    assert got and (out["acceptance_length"] == 0 or out["acceptance_length"] >= 1.0) and out["speedup_vs_plain"] > 0
    tok = AutoTokenizer.from_pretrained(str(llama))
    ref = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([tok(prompt).input_ids], device="cuda")
    want = ref.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.size(1):].tolist()
    same = sum(a == b for a, b in zip(got, want, strict=False)) / max(len(want), 1)
    print(f"hf bf16 generate: {json.dumps({k: v for k, v in out.items() if k != 'completions'})}, "
          f"greedy tokens equal to transformers' {same:.2f}")
