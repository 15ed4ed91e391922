"""bench-target: cost and accuracy of the target's idle-window instrumentation.

Keys (BENCHMARKS.md): instrumentation_overhead_ratio (median step time instrumented / not, runs
interleaved on/off), instrumentation_cost_fraction (time inside the instrumentation calls / step
time, a noise-free complement of the ratio), bubble_fraction_measured / bubble_fraction_formula (p=2, m=4; also per (p, m)
in {(2,4), (4,8)} as bubble_fraction_measured_p<p>_m<m>; and Interleaved1F1B p=2 m=4 with 2 chunks per
rank as bubble_fraction_measured_interleaved_p2_m4, its own bubble error alongside, not pooled), pred_error_median_bubble,
pred_error_median_comm (median |predicted - actual| / actual; comm over DDP buckets and pipeline
send/recv, also split per channel family).

Each run is real processes (launch_local, gloo, debug preset, 1 torch thread per rank).
instrumentation_overhead_ratio: one run (p=2 m=4) with SPECTRAIN_INSTRUMENT_INTERLEAVE=4: its steps are
instrumented in blocks of 4, in the order on off off on (then again), so instrumented and plain steps
alternate every ~160 ms under the same load, the same processes and the same memory layout; the key
is the median period of the instrumented steps / the median period of the others (a step's period:
from the previous step's metrics line to its own, averaged over the ranks, so it holds everything
the instrumentation costs a step: the window calls, the threads it wakes, writing the records).
instrumentation_overhead_ratio_runs: the same question between whole runs, `blocks` ABBA blocks of
runs (on, off, off, on; the next block off, on, on, off), per block the ratio of the geometric means of
the runs' median step times (a step's time is its slowest rank's), then the median over blocks
(_p10: the runs' 10th percentile step time instead); run-to-run differences of this shared machine
(5-15 % between identical runs) make it the coarser of the two. instrumentation_cost_fraction: the
"on" runs set SPECTRAIN_INSTRUMENT_COST_FILE, so each rank sums the CPU time (thread_time) its
threads spend inside the Instrument's entry points (window open/close with their predictions and
ring writes, compute EMA, sync points, the imbalance watch's window opening, the per-step learning in
end_step) per step (instrument.py);
per run the largest rank's sum over the measured steps / the sum of the step times, then the median
over runs (_wall: perf_counter time instead, which also counts waiting for a lock, the GIL or a CPU
inside a call). It includes the accounting's own clock reads (a few us per call) and leaves out
what the trainer does for the windows outside those calls (the send-waiter thread's queue
hand-off, MetricsWriter's JSON lines of closed windows between steps).
Measured bubble fraction per stage = Bubble windows' actual time / the time the stage spent in
the pipeline schedule (the executor's span per step, `pipeline_ms`: the optimizer step, loss
hand-over and metrics between steps are not part of what the formula describes), averaged over
stages; the first 2 steps (warm-up, no EMA yet) are left out. On a 2-core machine p = 4 puts two
stages on each core, so its bubble fraction is not the schedule's (stages also wait for CPU).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import median, parse_args, percentile, print_table, write_results
from spectrain_workloads.launch import launch_local, wait_all

WARMUP = 2
INTERLEAVE = 4      # steps per on/off block of the interleaved overhead run


def _config(path: Path, *, data: int, pipeline: int, microbatches: int, steps: int, seq_len: int,
            schedule: str = "1F1B") -> Path:
    path.write_text(json.dumps({"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob",
                                "metadata": {"name": "bench"}, "spec": {"mode": "Pretrain", "seed": 1, "target": {
                                    "image": "x", "nodes": data * pipeline, "procsPerNode": 1,
                                    "parallelism": {"data": data, "pipeline": pipeline, "microbatches": microbatches,
                                                    "schedule": schedule},
                                    "model": {"preset": "debug"},
                                    "data": {"source": "builtin:python-stdlib", "seqLen": seq_len,
                                             "batchSize": 2 * microbatches},
                                    "steps": steps, "checkpoint": {"everySteps": 10_000, "keep": 1}}}}))
    return path


def _run(root: Path, cfg: Path, world: int, env: dict[str, str]) -> Path:
    procs = launch_local(cfg, world, root, root / "ring",
                         env={"SPECTRAIN_DATA_MAX_BYTES": str(1 << 20), "SPECTRAIN_BUCKET_CAP_MB": "0.05", **env})
    codes = wait_all(procs, 600)
    if codes != [0] * world:
        raise RuntimeError(f"bench run failed {codes}: see {root}/logs")
    return root


def _read(root: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "metrics" / name).read_text().splitlines()]


def _step_times(root: Path, world: int) -> list[float]:
    # a step's time is its slowest rank's
    per_rank = [[s["step_time_s"] for s in _read(root, f"target-rank-{r}.jsonl")[WARMUP:]] for r in range(world)]
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def _windows(root: Path, world: int) -> list[dict[str, Any]]:
    return [w for r in range(world) for w in _read(root, f"windows-rank-{r}.jsonl") if w["step"] >= WARMUP]


def _bubble_fraction(root: Path, p: int) -> float:
    fr = []
    for r in range(p):
        idle = sum(w["actual_ns"] for w in _read(root, f"windows-rank-{r}.jsonl")
                   if w["kind"] == "Bubble" and w["step"] >= WARMUP) / 1e9
        fr.append(idle / (sum(s["pipeline_ms"] for s in _read(root, f"target-rank-{r}.jsonl")[WARMUP:]) / 1e3))
    return statistics.mean(fr)


def _cost_fraction(root: Path, world: int, kind: str) -> float:
    """Largest rank's time (kind: cpu or wall) inside instrumentation calls over the measured steps /
    the sum of their step times."""
    total = sum(_step_times(root, world))
    costs = []
    for r in range(world):
        per_step = json.loads((root / f"cost-rank-{r}.json").read_text())[f"per_step_{kind}_ns"]
        costs.append(sum(v for k, v in per_step.items() if int(k) >= WARMUP) / 1e9)
    return max(costs) / total


def _periods(root: Path, world: int) -> list[tuple[bool, float]]:
    """(instrumented, seconds) per step after the warm-up: a step's period is from the previous
    step's metrics line to its own (time_ns), so it holds everything a step costs (the schedule,
    the optimizer, writing the window records), averaged over the ranks (in a pipeline a rank's
    lateness shows up in its neighbours' next step, so a per-step max would count it twice)."""
    per_rank = [_read(root, f"target-rank-{r}.jsonl") for r in range(world)]
    out = []
    for i in range(WARMUP + 1, len(per_rank[0])):
        flags = {lines[i]["instrumented"] for lines in per_rank}
        assert len(flags) == 1, f"ranks disagree on whether step {i} is instrumented"
        dt = statistics.mean((lines[i]["time_ns"] - lines[i - 1]["time_ns"]) / 1e9 for lines in per_rank)
        out.append((flags.pop(), dt))
    return out


def _interleaved_ratio(periods: list[tuple[bool, float]]) -> float:
    """Median period of the instrumented steps / median of the others."""
    on = [t for f, t in periods if f]
    off = [t for f, t in periods if not f]
    return median(on) / median(off)


def _errors(ws: list[dict[str, Any]], kind: str, prefix: str = "") -> list[float]:
    return [abs(w["predicted_ns"] - w["actual_ns"]) / w["actual_ns"] for w in ws
            if w["kind"] == kind and w["predicted_ns"] > 0 and w["actual_ns"] > 0
            and w.get("channel", "").startswith(prefix)]


def main() -> None:
    args = parse_args(__doc__ or "")
    steps, blocks, seq = (12, 1, 128) if args.quick else (40, 3, 128)
    interleaved_steps = 160 if args.quick else 3000
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-target-") as tmp:
        base = Path(tmp)
        cfg24 = _config(base / "p2m4.json", data=1, pipeline=2, microbatches=4, steps=steps, seq_len=seq)
        on_runs, on_t, off_t, ratios, ratios_p10, costs, costs_wall = [], [], [], [], [], [], []
        for i in range(blocks):   # ABBA: on off off on, then off on on off
            order = ["on", "off", "off", "on"] if i % 2 == 0 else ["off", "on", "on", "off"]
            meds: dict[str, list[float]] = {"on": [], "off": []}
            lows: dict[str, list[float]] = {"on": [], "off": []}
            for j, name in enumerate(order):
                root = base / f"{name}-{i}-{j}"
                env = {"SPECTRAIN_INSTRUMENT": "1" if name == "on" else "0"}
                if name == "on":
                    env["SPECTRAIN_INSTRUMENT_COST_FILE"] = str(root / "cost")
                r = _run(root, cfg24, 2, env)
                times = _step_times(r, 2)
                meds[name].append(median(times))
                lows[name].append(percentile(times, 10))
                if name == "on":
                    on_runs.append(r)
                    on_t += times
                    costs.append(_cost_fraction(r, 2, "cpu"))
                    costs_wall.append(_cost_fraction(r, 2, "wall"))
                else:
                    off_t += times
            ratios.append(statistics.geometric_mean(meds["on"]) / statistics.geometric_mean(meds["off"]))
            ratios_p10.append(statistics.geometric_mean(lows["on"]) / statistics.geometric_mean(lows["off"]))
        res["instrumentation_overhead_ratio_runs"] = median(ratios)
        res["instrumentation_overhead_ratios_runs"] = [round(x, 4) for x in ratios]
        res["instrumentation_overhead_ratio_runs_p10"] = median(ratios_p10)
        res["instrumentation_cost_fraction"] = median(costs)
        res["instrumentation_cost_fraction_max"] = max(costs)
        res["instrumentation_cost_fraction_wall"] = median(costs_wall)
        res["instrumentation_overhead_ratio_runs_min"] = min(ratios)
        res["instrumentation_overhead_ratio_runs_max"] = max(ratios)
        r_il4 = _run(base / "interleaved", _config(base / "il4.json", data=1, pipeline=2, microbatches=4,
                                                   steps=interleaved_steps, seq_len=seq),
                     2, {"SPECTRAIN_INSTRUMENT_INTERLEAVE": str(INTERLEAVE)})
        periods = _periods(r_il4, 2)
        res["instrumentation_overhead_ratio"] = _interleaved_ratio(periods)
        res["instrumentation_overhead_steps"] = len(periods)
        res["step_period_ms_instrumented_median"] = median([t for f, t in periods if f]) * 1e3
        res["step_period_ms_plain_median"] = median([t for f, t in periods if not f]) * 1e3
        res["bubble_fraction_measured_p2_m4"] = statistics.mean(_bubble_fraction(r, 2) for r in on_runs)
        res["bubble_fraction_formula_p2_m4"] = 1 / 5
        cfg48 = _config(base / "p4m8.json", data=1, pipeline=4, microbatches=8, steps=steps, seq_len=seq // 2)
        r48 = _run(base / "p4m8", cfg48, 4, {})
        res["bubble_fraction_measured_p4_m8"] = _bubble_fraction(r48, 4)
        res["bubble_fraction_formula_p4_m8"] = 3 / 11
        cfg_il = _config(base / "il.json", data=1, pipeline=2, microbatches=4, steps=steps, seq_len=seq,
                         schedule="Interleaved1F1B")
        r_il = _run(base / "il", cfg_il, 2, {})
        res["bubble_fraction_measured_interleaved_p2_m4"] = _bubble_fraction(r_il, 2)
        res["bubble_fraction_formula_interleaved_p2_m4"] = 1 / 9      # (p-1)/(v*m+p-1), v = 2 chunks
        res["pred_error_median_bubble_interleaved"] = median(_errors(_windows(r_il, 2), "Bubble"))
        res["bubble_fraction_measured"] = res["bubble_fraction_measured_p2_m4"]
        res["bubble_fraction_formula"] = res["bubble_fraction_formula_p2_m4"]
        cfg_dp = _config(base / "dp.json", data=2, pipeline=1, microbatches=2, steps=steps, seq_len=seq)
        rdp = _run(base / "dp", cfg_dp, 2, {})
        ws = [w for r in on_runs for w in _windows(r, 2)] + _windows(rdp, 2)
        res["pred_error_median_bubble"] = median(_errors(ws + _windows(r48, 4), "Bubble"))
        res["pred_error_median_comm"] = median(_errors(ws, "Communication"))
        res["pred_error_median_comm_dp_bucket"] = median(_errors(ws, "Communication", "dp-bucket"))
        res["pred_error_median_comm_pp_send"] = median(_errors(ws, "Communication", "pp-send"))
        res["pred_error_median_comm_pp_recv"] = median(_errors(ws, "Communication", "pp-recv"))
        res["step_time_ms_on_median"] = median(on_t) * 1e3
        res["step_time_ms_off_median"] = median(off_t) * 1e3
    write_results("target", res, args.quick)
    print_table("bench-target" + (" (quick)" if args.quick else ""), res)


if __name__ == "__main__":
    main()
