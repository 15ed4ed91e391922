"""EAGLE-3 drafters trained by jobs (real processes through `spectrain run`): the feature layers come
from the pipeline stages holding them (harvest.feature_tap), travel over the authenticated fleet to
the last stage's drafter, which assembles the samples (drafter.eagle3_assembly); every stage's
drafter trains; the export is the project's layout plus, for a Hugging Face target, the sglang/ and
speculators/ layouts (checked against the loaders' tables); `spectrain generate` with it emits
transformers' greedy tokens (tiny Llama over 4 stages, tiny Qwen3 and tiny Qwen2 with tied embeddings
over 2); the project's debug preset over 2 stages assembles and trains the same way. The drafters run with activation Always so that the test does not
depend on this machine's window lengths (harvest in windows is the Eagle tests' subject)."""

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
# Long enough for every stage's drafter to be up (imports, the target's shared weights, the model) and
# harvesting well before the job ends, also under the full suite's load.
STEPS = 150


def job(target: dict[str, Any], *, pipeline: int, steps: int, drafter: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob", "metadata": {"name": "e3"},
            "spec": {"mode": "Pretrain", "seed": 3, "target": {
                "image": "x", "nodes": pipeline, "procsPerNode": 1,
                "env": [{"name": "SPECTRAIN_TORCH_THREADS", "value": "1"},
                        {"name": "SPECTRAIN_DATA_MAX_BYTES", "value": str(1 << 19)}],
                "parallelism": {"data": 1, "pipeline": pipeline, "microbatches": 4, "schedule": "1F1B"},
                "model": target, "data": {"source": "builtin:python-stdlib", "seqLen": 64, "batchSize": 8},
                "optimizer": {"lr": 3e-3}, "steps": steps, "checkpoint": {"everySteps": steps, "claimName": "e3-run"}},
                "drafter": {"preset": "debug", "activation": {"policy": "Always"}, "optimizer": {"lr": 4e-3},
                            "exchange": {"combineEverySeconds": 1}, **(drafter or {})},
                "gpuSharing": {"mode": "None"}}}


def run_job(tmp: Path, manifest: dict[str, Any]) -> Path:
    (tmp / "job.yaml").write_text(yaml.safe_dump(manifest))
    res = subprocess.run([*SPECTRAIN, "run", str(tmp / "job.yaml"), "--run-dir", str(tmp / "run"), "-q"], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return run_volume(tmp / "run")


def summaries(run: Path) -> dict[int, dict[str, Any]]:
    return {r: json.loads(p.read_text()) for r, p in rundir.drafter_summaries(run)}


@pytest.mark.parametrize(("arch", "pipeline", "drafter", "tie"), [
    ("LlamaForCausalLM", 4, {}, False),                         # layers (1, 2, 3): stage 0 holds none
    ("Qwen3ForCausalLM", 2, {"draftVocabSize": 200}, False),    # layer 1 on stage 0; a draft vocabulary
    ("Qwen2ForCausalLM", 2, {}, True),                          # the LM head is the embedding (tied)
], ids=["llama-p4", "qwen3-p2", "qwen2-tied-p2"])
def test_eagle3_by_default_features_from_every_stage_exports_conform_generate_is_greedy(
        tmp_path: Path, arch: str, pipeline: int, drafter: dict[str, Any], tie: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spectrain_workloads.drafter.eagle3_tables import layout_problems
    from spectrain_workloads.drafter.export import resolve_export

    model = build_model(tmp_path / "model", arch, layers=4, tie=tie, seed=2)
    run = run_job(tmp_path, job({"path": f"file://{model}"}, pipeline=pipeline, steps=STEPS, drafter=drafter))
    s = summaries(run)
    last = pipeline - 1
    assert sorted(s) == list(range(pipeline))
    assert all(s[r]["arch"] == "Eagle3" and s[r]["samplesTrained"] > 0 for r in s), s
    senders = {r for r in range(last) if s[r]["featurePartsSent"] > 0}
    assert senders == ({1, 2} if pipeline == 4 else {0}), s      # the stages holding feature layers
    assert s[last]["featureSamplesAssembled"] > 0 and s[last]["featurePartsRejected"] == 0
    assert all(s[r]["samplesFromPeers"] > 0 for r in range(last))   # assembled samples reach every stage
    counts = run / "target" / "shared" / "token_counts.safetensors"
    assert counts.is_file() == ("draftVocabSize" in drafter)       # only a draft vocabulary below V counts
    export = resolve_export(run / "drafter")
    assert sorted(p.name for p in export.iterdir() if p.is_dir()) == ["sglang", "speculators"]
    for layout in ("sglang", "speculators"):
        assert layout_problems(export / layout) == [], layout
    spec = json.loads((export / "speculators" / "config.json").read_text())
    assert spec["draft_vocab_size"] == drafter.get("draftVocabSize", spec["transformer_layer_config"]["vocab_size"])
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(rundir.target_hf(run))
    target = run / "target" / "hf"
    prompt = "def main(argv):\n    "
    res = subprocess.run([*SPECTRAIN, "generate", "--model", str(target), "--drafter", str(run / "drafter"),
                          "--prompt", prompt, "--max-new-tokens", "24", "--temperature", "0", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])["completions"][0]["token_ids"]
    tok = AutoTokenizer.from_pretrained(str(target))
    ref_model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    ids = torch.tensor([tok(prompt).input_ids])
    ref = ref_model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.size(1):].tolist()
    eos = ref_model.config.eos_token_id
    assert got == (ref[: ref.index(eos) + 1] if eos in ref else ref)


def test_eagle3_on_the_project_s_debug_preset_over_two_stages(tmp_path: Path) -> None:
    """The project's own target (preset debug) with arch Eagle3: stage 0 sends its feature layer's parts,
    the last stage assembles them with none rejected, both drafters train, and the export is the
    project's layout only (the serving layouts are for Hugging Face targets)."""
    from spectrain_workloads.drafter.export import resolve_export

    run = run_job(tmp_path, job({"preset": "debug"}, pipeline=2, steps=STEPS, drafter={"arch": "Eagle3"}))
    s = summaries(run)
    assert sorted(s) == [0, 1] and all(s[r]["arch"] == "Eagle3" and s[r]["samplesTrained"] > 0 for r in s), s
    assert s[0]["featurePartsSent"] > 0, s
    assert s[1]["featureSamplesAssembled"] > 0 and s[1]["featurePartsRejected"] == 0, s
    assert s[0]["samplesFromPeers"] > 0, s
    export = resolve_export(run / "drafter")
    assert not [p.name for p in export.iterdir() if p.is_dir()], "no serving layout without a Hugging Face target"
