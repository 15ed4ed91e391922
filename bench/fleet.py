"""bench-fleet: what the drafters of every rank add to the one exported drafter.

One debug Pretrain job of pipeline 2 x data 2 (4 ranks on 2 pods, `spectrain run`: the pods'
real processes, gloo on CPU), run in three variants, interleaved (A B C A B C ...), each for the
same number of target steps:
- combined: drafters on every rank, exchange on (drafter.fleet: the last stages' samples reach
  the first stages' drafters; every replica is averaged into the export);
- single:   drafters on every rank, exchange off: only the exporting rank's drafter reaches the
  export (what a job got before the fleet);
- off:      no drafter (the target alone).

ranks_training_fraction   drafters that trained (samplesTrained > 0) / drafters, combined runs
samples_combined_ratio    samples whose training reached the exported model: combined (the
                          coordinator's exportSamplesByRank, all ranks) / single (the exporting
                          rank's samplesTrained)
acceptance_combined       expected accepted length (k=4) of each variant's export on held-out text
acceptance_single         through the final target of that run (what a speculative decoder verifies)
alpha_t1_combined         the same exports' sampled acceptance rate (sum min(p, q), temperature 1,
alpha_t1_single           teacher-forced; drafter/verify.py): at 120 steps the debug target puts
                          nearly all its mass on two tokens, so the greedy length saturates (4.89
                          for any trained drafter) and only this one tells the variants apart
target_slowdown_ratio     median target step time, combined / off (drafters and exchange on vs off)
exchange_mb_per_s         bytes the drafters sent to each other / run wall time, combined runs

On 2 shared CPU cores the 4 target ranks and 4 drafters compete for the same cores, so the
slowdown here is CPU contention, not what a GPU job sees (docs/benchmarks.md).

Run: python -m bench.fleet [--quick]   (make bench-fleet [QUICK=1])
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from bench.common import median, parse_args, print_table, write_results

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("combined", "single", "off")
N_LAYERS, SEQ = 4, 128


def manifest(variant: str, steps: int) -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    t = job["spec"]["target"]
    t.update(nodes=2, procsPerNode=2, steps=steps)
    t["parallelism"].update(data=2, pipeline=2, microbatches=4)
    t["model"]["overrides"] = {"n_layers": N_LAYERS}
    t["data"].update(seqLen=SEQ, batchSize=8)
    t["checkpoint"] = {"everySteps": steps, "keep": 1}
    d = job["spec"]["drafter"]
    d["enabled"] = variant != "off"
    d["exchange"] = {"enabled": variant == "combined", "combineEverySeconds": 2}
    job["metadata"]["name"] = f"fleet-{variant}"
    return job


def run(variant: str, steps: int, root: Path) -> dict[str, Any]:
    run_dir = root / f"{variant}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    path = run_dir / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(variant, steps)))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "spectrain_operator.cli", "run", str(path), "--run-dir",
                          str(run_dir / "run")], cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if res.returncode != 0:
        raise SystemExit(f"{variant} run failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    data = run_dir / "run" / "run"
    steps_s = [json.loads(line)["step_time_s"] for line in (data / "metrics" / "target-rank-0.jsonl").open()][2:]
    out: dict[str, Any] = {"variant": variant, "wall_s": wall, "step_s": median(steps_s), "data": data}
    if variant != "off":
        out["summaries"] = [json.loads((data / f"drafter-summary-rank-{r}.json").read_text()) for r in range(4)]
        out["acceptance"], out["alpha_t1"] = acceptance(data)
    return out


def final_target(data: Path, n_layers: int = N_LAYERS) -> Any:
    """The debug target of a pipeline-2 run at its last checkpoint (replica 0's stages: ranks 0, 1)."""
    from spectrain_workloads.model import Transformer, model_config

    cfg = model_config("debug", {"n_layers": n_layers}, vocab_size=264)
    model = Transformer(cfg)
    state: dict[str, torch.Tensor] = {}
    for rank in (0, 1):                   # replica 0's stages hold the whole model
        rank_dir = data / "target" / f"rank-{rank}"
        step = max(int(p.name[5:]) for p in rank_dir.glob("step-*"))
        state.update(torch.load(rank_dir / f"step-{step}" / "state.pt", map_location="cpu", weights_only=False)["model"])
    model.load_state_dict(state)
    return model.eval()


def heldout(target: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """16 held-out text sequences (not the job's data stream) and the target's hidden states."""
    from spectrain_workloads.drafter.synthetic import target_hidden, text_sequences

    tokens = text_sequences(16, 64, seed=4321)
    hidden = target_hidden(target, tokens)
    return [(tokens[i], hidden[i]) for i in range(len(tokens))]


def acceptance(data: Path, target: Any = None) -> tuple[float, float]:
    """(expected accepted length at k=4, sampled acceptance rate) of the run's export on held-out text
    through its final target."""
    from spectrain_workloads.drafter.export import load_drafter
    from spectrain_workloads.drafter.verify import measure, sampled_acceptance_rate

    target = final_target(data) if target is None else target
    drafter, _ = load_drafter(data / "drafter")
    drafter.load_target_weights(target.tok_embeddings.weight, target.output.weight)
    samples = heldout(target)
    return float(measure(drafter, samples, None, k=4).acceptance_length), sampled_acceptance_rate(drafter, samples)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps, rounds = (40, 1) if args.quick else (120, 3)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="spectrain-bench-fleet-") as tmp:
        for i in range(rounds):
            for v in VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS)):
                r = run(v, steps, Path(tmp))
                results[v].append(r)
                print(f"  round {i} {v}: {r['wall_s']:.0f} s, step {r['step_s'] * 1e3:.0f} ms"
                      + (f", acceptance {r['acceptance']:.2f}, alpha {r['alpha_t1']:.3f}" if "acceptance" in r
                         else ""), flush=True)
    comb, single = results["combined"], results["single"]
    trained = [sum(s["samplesTrained"] > 0 for s in r["summaries"]) / 4 for r in comb]
    # the coordinator's count (rank 3): it holds the members' last contributions, which reach the
    # final export after the members stopped (their own combinedSamples cannot include those)
    reached_comb = [sum(r["summaries"][3].get("exportSamplesByRank", {}).values()) for r in comb]
    reached_single = [r["summaries"][3]["samplesTrained"] for r in single]       # rank 3 exports
    keys = {
        "ranks_training_fraction": min(trained),
        "samples_combined_ratio": median(reached_comb) / max(1.0, median(reached_single)),
        "acceptance_combined": median([r["acceptance"] for r in comb]),
        "acceptance_single": median([r["acceptance"] for r in single]),
        "alpha_t1_combined": median([r["alpha_t1"] for r in comb]),
        "alpha_t1_single": median([r["alpha_t1"] for r in single]),
        "target_slowdown_ratio": median([r["step_s"] for r in comb]) / median([r["step_s"] for r in results["off"]]),
        "exchange_mb_per_s": median([sum(s.get("exchangeBytesSent", 0) for s in r["summaries"]) / 1e6 / r["wall_s"]
                                     for r in comb]),
        "samples_reached_combined": median(reached_comb),
        "samples_reached_single": median(reached_single),
        "step_ms_off": median([r["step_s"] for r in results["off"]]) * 1e3,
        "rounds": rounds,
        "steps": steps,
        "step_ms_spread_off": statistics.pstdev([r["step_s"] for r in results["off"]]) * 1e3 if rounds > 1 else 0.0,
    }
    goals = {"ranks_training_fraction": keys["ranks_training_fraction"] >= 1.0,
             "samples_combined_ratio": keys["samples_combined_ratio"] >= 3.0,
             "acceptance_combined_ge_single": keys["acceptance_combined"] >= keys["acceptance_single"],
             "alpha_t1_combined_ge_single": keys["alpha_t1_combined"] >= keys["alpha_t1_single"],
             "target_slowdown_ratio": keys["target_slowdown_ratio"] <= 1.03}
    print_table("bench-fleet (pipeline 2 x data 2, debug)", keys)
    print_table("goals met", goals)
    write_results("fleet", {**keys, "goals_met": goals}, args.quick)


if __name__ == "__main__":
    main()
