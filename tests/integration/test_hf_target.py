"""Hugging Face targets end to end: a tiny random Llama (untied) and Qwen2 (tied
embeddings) built here with transformers, trained with 2 pipeline stages and the drafter through
`spectrain run`. Checks: the pipelined loss is the single-process HF model's loss; the loss falls;
the trained target loads with from_pretrained; the drafter export passes the serving conformance
table; `spectrain generate --temperature 0` emits transformers' greedy tokens. No hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from spectrain_api import rundir
from spectrain_operator.local_layout import run_volume
from spectrain_workloads.hf.tiny import build_model

pytestmark = pytest.mark.integration
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[2]
SPECTRAIN = [sys.executable, "-m", "spectrain_operator.cli"]
STEPS = 200
SEQ, BATCH = 128, 8        # bubbles (one microbatch's forward + backward) long enough for the drafter
CORPUS_BYTES = 1 << 20     # SPECTRAIN_DATA_MAX_BYTES: the text each rank tokenizes


def job_for(model: Path) -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / "hf-llama.yaml").read_text())
    t, d = job["spec"]["target"], job["spec"]["drafter"]
    t["model"] = {"path": f"file://{model}"}
    t["data"] = {"source": "builtin:python-stdlib", "seqLen": SEQ, "batchSize": BATCH}
    t["parallelism"]["microbatches"] = 2
    t["optimizer"] = {"lr": 3e-3}
    t["steps"] = STEPS
    t["checkpoint"] |= {"everySteps": STEPS // 2}
    t["env"] = [{"name": "SPECTRAIN_TORCH_THREADS", "value": "1"},
                {"name": "SPECTRAIN_DATA_MAX_BYTES", "value": str(CORPUS_BYTES)}]
    d.update({"preset": "debug", "optimizer": {"lr": 4e-3}})
    return job


@pytest.fixture(scope="module", params=[("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True)],
                ids=["llama", "qwen2-tied"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arch, tied = request.param
    tmp = tmp_path_factory.mktemp(arch)
    model = build_model(tmp / "model", arch, tie=tied, seed=3)
    manifest = tmp / "job.yaml"
    job = job_for(model)
    manifest.write_text(yaml.safe_dump(job))
    run_dir = tmp / "run"
    res = subprocess.run([*SPECTRAIN, "run", str(manifest), "--run-dir", str(run_dir), "-q"], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    harvested = [json.loads(rundir.drafter_summary(run_volume(run_dir), r).read_text())["harvestedSeconds"]
                 for r in (0, 1)]
    assert sum(harvested) > 0, harvested     # the drafters trained in the target's idle windows
    return {"arch": arch, "tied": tied, "model": model, "run": run_volume(run_dir), "job": job}


def step_losses(run: Path) -> list[float]:
    rows = [json.loads(ln) for ln in (run / "metrics" / "target-rank-0.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and r.get("step") is not None]


def first_batch(job: dict[str, Any], model: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's batch as the trainer builds it (same corpus, tokenizer and loader)."""
    from spectrain_api.config import from_manifest
    from spectrain_workloads.data import LoaderSpec, TokenLoader
    from spectrain_workloads.target_model import resolve_target

    cfg = from_manifest(job)
    target = resolve_target(cfg)
    corpus = target.load_corpus(cfg.target.data.source, max_bytes=CORPUS_BYTES)
    loader = TokenLoader(corpus, LoaderSpec(seq_len=SEQ, batch_size=BATCH, seed=cfg.seed))
    return loader.batch(0)


def test_pipelined_loss_is_the_hf_models_and_falls(trained: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    losses = step_losses(trained["run"])
    assert len(losses) == STEPS
    inputs, targets = first_batch(trained["job"], trained["model"])
    ref = AutoModelForCausalLM.from_pretrained(str(trained["model"])).eval()
    with torch.no_grad():
        logits = ref(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(losses[0] - want) < 1e-4 * want, (losses[0], want)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def test_trained_target_loads_with_from_pretrained(trained: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    out = trained["run"] / "target" / "hf"
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(model).__name__ == trained["arch"]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    start = AutoModelForCausalLM.from_pretrained(str(trained["model"]))
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, start.model.layers[0].mlp.up_proj.weight)
    if trained["tied"]:   # one matrix at both ends after training with the two halves on two stages
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        last = json.loads((trained["run"] / "target" / "hf" / "model.safetensors.index.json").read_text())
        assert "lm_head.weight" not in last["weight_map"]
        from safetensors.torch import load_file  # the two stages' copies stayed one matrix (summed grads)

        shared = trained["run"] / "target" / "shared"
        emb, head = (load_file(str(shared / f"{n}.safetensors"))["weight"] for n in ("embedding", "lm_head"))
        assert torch.equal(emb, head)
        assert torch.equal(head, model.lm_head.weight.detach())


def test_export_conforms_and_generate_matches_transformers_greedy(trained: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spectrain_workloads.drafter.export import resolve_export
    from spectrain_workloads.drafter.serving_export import check_serving_layout

    export = resolve_export(trained["run"] / "drafter")
    engines = sorted(p.name for p in export.iterdir() if p.is_dir())
    assert engines == ["sglang", "vllm"]
    for engine in engines:
        assert check_serving_layout(export / engine) == [], engine
    target = trained["run"] / "target" / "hf"
    prompt = "def main(argv):\n    "
    res = subprocess.run([*SPECTRAIN, "generate", "--model", str(target), "--drafter", str(trained["run"] / "drafter"),
                          "--prompt", prompt, "--max-new-tokens", "24", "--temperature", "0", "--compare", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out) == {"completions", "acceptance_length", "tokens_per_s", "k_histogram", "plain_share",
                        "speedup_vs_plain", "speedup_spread", "compare_pairs"}
    assert sum(out["k_histogram"].values()) > 0 and 0.0 <= out["plain_share"] <= 1.0
    assert out["speedup_spread"][0] <= out["speedup_vs_plain"] <= out["speedup_spread"][1]
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    ids = torch.tensor([tok(prompt).input_ids])
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.size(1):].tolist()
    eos = model.config.eos_token_id
    got = out["completions"][0]["token_ids"]
    assert got == ref[: ref.index(eos) + 1] if eos in ref else got == ref
    assert out["completions"][0]["text"] == tok.decode(got, skip_special_tokens=True)
    # the adaptive controller may decode plainly throughout (then no verification: 0)
    assert (out["acceptance_length"] == 0 or out["acceptance_length"] >= 1.0) and out["tokens_per_s"] > 0


def test_a_short_job_leaves_a_drafter_generate_loads(tmp_path: Path) -> None:
    """A job over before its drafter could train still exports one (its initial weights at worst),
    so `spectrain generate` on the trained model works and stays transformers' greedy decoding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = build_model(tmp_path / "model", "LlamaForCausalLM", layers=2, seed=9)
    job = job_for(model)
    job["spec"]["target"]["steps"] = 4
    job["spec"]["target"]["checkpoint"] |= {"everySteps": 2}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    res = subprocess.run([*SPECTRAIN, "run", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run"), "-q"],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = run_volume(tmp_path / "run")
    prompt = "import os\n"
    res = subprocess.run([*SPECTRAIN, "generate", "--model", str(run / "target" / "hf"), "--drafter",
                          str(run / "drafter"), "--prompt", prompt, "--max-new-tokens", "16", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])["completions"][0]["token_ids"]
    tok = AutoTokenizer.from_pretrained(str(run / "target" / "hf"))
    ref_model = AutoModelForCausalLM.from_pretrained(str(run / "target" / "hf")).eval()
    ids = torch.tensor([tok(prompt).input_ids])
    ref = ref_model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.size(1):].tolist()
    eos = ref_model.config.eos_token_id
    assert got == (ref[: ref.index(eos) + 1] if eos in ref else ref)


def test_rl_smoke_with_an_hf_target(tmp_path: Path) -> None:
    """Mode RL on a tiny Llama: its tokenizer encodes the task, rollouts run the project's engine on
    the HF layers with the drafter built of the same layer class, and the rewards are logged."""
    model = build_model(tmp_path / "model", "LlamaForCausalLM", layers=2, seed=5)
    job = yaml.safe_load((ROOT / "examples" / "demo-rl.yaml").read_text())
    t = job["spec"]["target"]
    t["model"] = {"path": f"file://{model}"}
    t["steps"] = 6
    t["checkpoint"] |= {"everySteps": 3}
    t["env"] = [{"name": "SPECTRAIN_RL_WARMUP_STEPS", "value": "20"}]
    t["rl"]["maxNewTokens"] = 16
    manifest = tmp_path / "rl.yaml"
    manifest.write_text(yaml.safe_dump(job))
    res = subprocess.run([*SPECTRAIN, "run", str(manifest), "--run-dir", str(tmp_path / "run"), "-q"], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run_volume(tmp_path / "run") / "metrics" / "target-rank-0.jsonl").read_text()
            .splitlines()]
    steps = [r for r in rows if r.get("step") is not None and "reward" in r]
    assert [r["step"] for r in steps] == list(range(1, 7)), rows[:2]
    assert all(0.0 <= r["reward"] <= 1.0 for r in steps)
    shared = json.loads((run_volume(tmp_path / "run") / "target" / "shared" / "model_config.json").read_text())
    assert shared["hf_config"]["architectures"] == ["LlamaForCausalLM"]


def test_tied_pipeline_resume_is_bitwise(tmp_path: Path) -> None:
    """An HF target (Qwen2, tied embeddings over 2 stages) stopped at a checkpoint and resumed gives the
    uninterrupted run's losses bitwise (the target processes alone, as tests/launch.py runs them)."""
    from tests.launch import launch_local, wait_all

    model = build_model(tmp_path / "model", "Qwen2ForCausalLM", layers=2, tie=True, seed=4)

    def run(root: Path, steps: int) -> list[float]:
        job = job_for(model)
        job["spec"]["target"]["steps"] = steps
        job["spec"]["target"]["checkpoint"] |= {"everySteps": 3}
        job["spec"]["target"]["data"] = {"source": "builtin:python-stdlib", "seqLen": 32, "batchSize": 4}
        cfg = root / "job.json"
        root.mkdir(exist_ok=True)
        cfg.write_text(json.dumps(job))
        procs = launch_local(cfg, 2, root, root / "ring", env={"SPECTRAIN_DATA_MAX_BYTES": str(CORPUS_BYTES)})
        codes = wait_all(procs, 300)
        assert codes == [0, 0], "\n".join(p.read_text()[-2000:] for p in sorted((root / "logs").glob("*.log")))
        return step_losses(root)

    whole = run(tmp_path / "whole", 6)
    run(tmp_path / "split", 3)
    resumed = run(tmp_path / "split", 6)
    assert resumed == whole and len(whole) == 6
