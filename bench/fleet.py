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
auth_overhead_ratio       drafter throughput (samples trained from samples that came through the
                          exchange, per CPU-second of the drafter's process) with the fleet's trust
                          off / on: a last stage (a process, also the coordinator) streams
                          debug-target samples at the default 64 MB/s cap to a first stage that
                          trains the debug Eagle drafter on what it takes, and sends it a combined
                          version every COMBINE_S. On: frame MACs, per-pod identities (signed
                          handshakes, X25519 session keys), signed combined versions, the checks of
                          sample values and weights; off: none of them (FleetConfig.trust, which
                          exists for this only), interleaved in the same run. auth_overhead_ratio_wall:
                          the same per second of wall time

On 2 shared CPU cores the 4 target ranks and 4 drafters compete for the same cores, so the
slowdown here is CPU contention, not what a GPU job sees (docs/benchmarks.md).

Run: python -m bench.fleet [--quick]   (make bench-fleet [QUICK=1])
"""

from __future__ import annotations

import json
import os
import socket
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
from spectrain_api import rundir
from spectrain_operator.local_layout import run_volume

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("combined", "single", "off")
N_LAYERS, SEQ = 4, 128
COMBINE_S = 2.0          # the jobs' combineEverySeconds: a combined version this often in the throughput runs


def manifest(variant: str, steps: int) -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    t = job["spec"]["target"]
    t.update(nodes=2, procsPerNode=2, steps=steps)
    t["parallelism"].update(data=2, pipeline=2, microbatches=4)
    t["model"]["overrides"] = {"n_layers": N_LAYERS}
    t["data"].update(seqLen=SEQ, batchSize=8)
    t["checkpoint"] |= {"everySteps": steps, "keep": 1}
    d = job["spec"]["drafter"]
    d["enabled"] = variant != "off"
    d["exchange"] = {"enabled": variant == "combined", "combineEverySeconds": COMBINE_S}
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
    data = run_volume(run_dir / "run")
    steps_s = [json.loads(line)["step_time_s"] for line in (data / "metrics" / "target-rank-0.jsonl").open()][2:]
    out: dict[str, Any] = {"variant": variant, "wall_s": wall, "step_s": median(steps_s), "data": data}
    if variant != "off":
        out["summaries"] = [json.loads(rundir.drafter_summary(data, r).read_text()) for r in range(4)]
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


def _sender(ports: list[int], key: bytes, trust: bool, private: bytes, peers: Any, stop: Any) -> None:
    """The last stage's side and coordinator, a process of its own: debug-target samples as fast as
    the cap lets them go, and a combined version (the drafter's weights) every COMBINE_S."""
    from spectrain_api.config import model_config
    from spectrain_workloads.drafter.fleet import Fleet
    from spectrain_workloads.drafter.fleet_records import Combined, FleetConfig
    from spectrain_workloads.drafter.identity import PodIdentity
    from spectrain_workloads.drafter.models import EagleDrafter

    torch.set_num_threads(1)
    cfg = model_config("debug", {"n_layers": N_LAYERS}, vocab_size=264)
    fleet = Fleet(FleetConfig(rank=1, world=2, pipeline=2, coordinator=1, addresses=[("127.0.0.1", p) for p in ports],
                              key=key, pod=PodIdentity(private, peers), job_uid="bench", trust=trust))
    torch.manual_seed(0)
    params = {n: p.detach() for n, p in EagleDrafter(cfg).named_parameters() if p.requires_grad}
    tokens, hidden = torch.randint(0, cfg.vocab_size, (SEQ,)), torch.randn(SEQ, cfg.dim)
    version, last = 0, time.monotonic()
    while not stop.is_set():
        fleet.share(tokens, hidden, step=0)
        if time.monotonic() - last >= COMBINE_S:
            version, last = version + 1, time.monotonic()
            fleet._broadcast(Combined(version, params, {1: version}, 1.0), [0])   # what `combine` sends
        stop.wait(SEQ * (cfg.dim * 4 + 8) / 64e6)      # one sample's share of the default cap
    fleet.close()


def _throughput(trust: bool, seconds: float) -> tuple[float, float]:
    """(samples per second, per CPU-second of this process) the debug Eagle drafter (one CPU
    thread, as the sidecar's default) trains on from what a last stage sends it at the cap; the
    first batch (lazy initialisation) is not timed. Per CPU-second: the drafter's own cost (its
    training, reading and checking frames, their MACs), which other load on a shared machine
    does not change. Combined versions are checked (trust on) and applied as they come."""
    import multiprocessing as mp

    from spectrain_api.config import model_config
    from spectrain_workloads.drafter.checks import TargetSpec
    from spectrain_workloads.drafter.fleet import Fleet
    from spectrain_workloads.drafter.fleet_records import FleetConfig
    from spectrain_workloads.drafter.identity import PodIdentity, mint_local
    from spectrain_workloads.drafter.models import EagleDrafter, eagle_loss

    torch.set_num_threads(1)
    cfg = model_config("debug", {"n_layers": N_LAYERS}, vocab_size=264)
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    key = os.urandom(32)
    private, peers = mint_local("bench", 0, 1, 2)
    fleet = Fleet(FleetConfig(rank=0, world=2, pipeline=2, coordinator=1, addresses=[("127.0.0.1", p) for p in ports],
                              key=key, pod=PodIdentity(private[0], peers), job_uid="bench", trust=trust))
    torch.manual_seed(0)
    drafter = EagleDrafter(cfg)
    local = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    fleet.expect(local, TargetSpec(cfg.vocab_size, cfg.dim, cfg.max_seq_len))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    sender = ctx.Process(target=_sender, args=(ports, key, trust, private[1], peers, stop), daemon=True)
    sender.start()
    trained, t0, c0 = 0, None, 0.0
    try:
        while t0 is None or time.monotonic() - t0 < seconds:
            c = fleet.take_combined()
            if c is not None and (not trust or fleet.accept_update(c.params, local)):
                with torch.no_grad():
                    for n, p in local.items():
                        p.copy_(c.params[n])
                fleet.stats.add(bench_versions_applied=1)
            got = fleet.take_samples(8)
            if not got:
                time.sleep(0.001)            # nothing arrived yet: a bench loop, not the worker
                continue
            loss, _ = eagle_loss(drafter, torch.stack([t for t, _, _, _ in got]),
                                 torch.stack([h for _, h, _, _ in got]).float(), hidden_weight=1.0,
                                 ce_weight=0.1, stats=False)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if t0 is None:
                t0, c0 = time.monotonic(), time.process_time()
            else:
                trained += len(got)
        applied, refused = fleet.stats.snapshot().get("bench_versions_applied", 0), fleet.stats.rejected()
        print(f"    {applied} combined versions applied, refused: {refused or 'none'}", flush=True)
        return trained / (time.monotonic() - t0), trained / (time.process_time() - c0)
    finally:
        stop.set()
        sender.join(timeout=30)
        fleet.close()


def auth_overhead(rounds: int, seconds: float) -> dict[str, Any]:
    """Throughput with the fleet's trust off / on (medians of interleaved runs: on, off, off, on, ...),
    per CPU-second of the drafter (the key) and per second of wall time (noisy on a shared machine)."""
    got: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    for i in range(rounds):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            got[mode].append(_throughput(mode == "on", seconds))
            print(f"  trust {mode}: {got[mode][-1][0]:.0f} samples/s, {got[mode][-1][1]:.0f} per CPU-second", flush=True)
    on_wall, on_cpu = (median([r[i] for r in got["on"]]) for i in (0, 1))
    off_wall, off_cpu = (median([r[i] for r in got["off"]]) for i in (0, 1))
    return {"auth_overhead_ratio": off_cpu / on_cpu, "auth_overhead_ratio_wall": off_wall / on_wall,
            "auth_samples_per_cpu_s_on": on_cpu, "auth_samples_per_cpu_s_off": off_cpu}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps, rounds = (40, 1) if args.quick else (120, 3)
    auth = auth_overhead(2 if args.quick else 6, 5.0 if args.quick else 10.0)
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
        **auth,
        "rounds": rounds,
        "steps": steps,
        "step_ms_spread_off": statistics.pstdev([r["step_s"] for r in results["off"]]) * 1e3 if rounds > 1 else 0.0,
    }
    goals = {"ranks_training_fraction": keys["ranks_training_fraction"] >= 1.0,
             "samples_combined_ratio": keys["samples_combined_ratio"] >= 3.0,
             "acceptance_combined_ge_single": keys["acceptance_combined"] >= keys["acceptance_single"],
             "alpha_t1_combined_ge_single": keys["alpha_t1_combined"] >= keys["alpha_t1_single"],
             "target_slowdown_ratio": keys["target_slowdown_ratio"] <= 1.03,
             "auth_overhead_ratio": keys["auth_overhead_ratio"] <= 1.02}
    print_table("bench-fleet (pipeline 2 x data 2, debug)", keys)
    print_table("goals met", goals)
    write_results("fleet", {**keys, "goals_met": goals}, args.quick)


if __name__ == "__main__":
    main()
