"""bench-target: cost and accuracy of the target's idle-window instrumentation.

Keys (BENCHMARKS.md): instrumentation_overhead_ratio (median step period instrumented / not, steps
interleaved on/off in one run), bubble_fraction_measured / bubble_fraction_formula (p=2, m=4; also per
(p, m) in {(2,4), (4,8)} as bubble_fraction_measured_p<p>_m<m>, and Interleaved1F1B p=2 m=4 with 2
chunks per rank as bubble_fraction_measured_interleaved_p2_m4), pred_error_median_bubble,
pred_error_median_comm (median |predicted - actual| / actual; comm over DDP buckets and pipeline
send/recv, also split per channel family).

Two models. The goal keys (no suffix) are measured on the `small` preset (dim 256, 8 layers; a p=2
m=4 step takes ~0.4 s on this CPU, still shorter than a GPU training step of a real model), the same
keys with `_debug` on the `debug` preset the tests use (~43 ms steps). A window costs the same on
both (~20 us of CPU per call, ~30 calls per step), so on `debug` that fixed cost weighs ten times as
much, and `debug`'s sub-millisecond transfers and bubbles are the size of this shared 2-core host's
scheduling jitter. DDP buckets: 2 MB for `small`, 0.05 MB for `debug`, about as many per step (11 / 12).

Each run is real processes (launch_local, gloo, 1 torch thread per rank).
instrumentation_overhead_ratio: one run (p=2 m=4) with SPECTRAIN_INSTRUMENT_INTERLEAVE=4: its steps are
instrumented in blocks of 4, in the order on off off on (then again), so instrumented and plain steps
alternate under the same load, the same processes and the same memory layout; the key is the median
period of the instrumented steps / the median period of the others (a step's period: from the
previous step's metrics line to its own, averaged over the ranks, so it holds everything the
instrumentation costs a step: the window calls, the threads it wakes, writing the records).
instrumentation_overhead_ratio_runs_debug: the same question between whole `debug` runs, `blocks` ABBA
blocks of runs (on, off, off, on; the next block off, on, on, off), per block the ratio of the
geometric means of the runs' median step times (a step's time is its slowest rank's), then the median
over blocks (_p10: the runs' 10th percentile step time instead); run-to-run differences of this shared
machine (5-15 % between identical runs) make it the coarser of the two.
instrumentation_cost_fraction_debug: the "on" runs set SPECTRAIN_INSTRUMENT_COST_FILE, so each rank
sums the CPU time (thread_time) its threads spend inside the Instrument's entry points (window
open/close with their predictions and ring writes, compute EMA, sync points, the imbalance watch's
window opening, the per-step learning in end_step) per step (harvest/instrument.py); per run the largest
rank's sum over the measured steps / the sum of the step times, then the median over runs (_wall:
perf_counter time instead, which also counts waiting for a lock, the GIL or a CPU inside a call).
pred_error_hindsight_comm (and per channel family): the median error if each transfer were predicted
by the one constant per transfer key that suits that key's durations in this run best, chosen in
hindsight (`_hindsight_constant_error`): the scale of the spread a prediction works against.
Measured bubble fraction per stage = Bubble windows' actual time / the time the stage spent in
the pipeline schedule (the executor's span per step, `pipeline_ms`: the optimizer step, loss
hand-over and metrics between steps are not part of what the formula describes), averaged over
stages; the first 2 steps (warm-up, no EMA yet) are left out. On a 2-core machine p = 4 puts two
stages on each core, so its bubble fraction is not the schedule's (stages also wait for CPU).

SPECTRAIN_DEVICE=cuda (`make gpu-check`): only the goal keys (the `small` runs, full step counts), ranks
on CUDA, written to bench/results/target_gpu.json with the same key names. With fewer GPUs than ranks
the ranks share GPU 0: NCCL refuses two ranks on one device and gloo sends host memory only, so their
process group is gloo, DDP all-reduces on gloo's CUDA path, and point-to-point transfers go through host
memory (`_SHARED_GPU`, loaded into each rank as a sitecustomize); with a GPU per rank nothing changes.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import median, parse_args, percentile, print_table, write_results
from tests.launch import launch_local, wait_all

WARMUP = 2
INTERLEAVE = 4      # steps per on/off block of the interleaved overhead run
SEQ = 128
DEBUG_BUCKET_MB = "0.05"   # DDP bucket cap: 12 buckets per step of the debug model
SMALL_BUCKET_MB = "2"      # ... 11 of the small model
DEVICE = "cuda" if os.environ.get("SPECTRAIN_DEVICE") == "cuda" else "cpu"   # benches run on CPU by default

# Ranks sharing one GPU (module docstring): the trainer's calls, redirected to what gloo can do.
_SHARED_GPU = '''
import torch
import torch.distributed as dist

_init, _isend, _irecv, _recv = dist.init_process_group, dist.isend, dist.irecv, dist.recv


def _gloo(backend=None, *args, **kwargs):
    return _init("gloo", *args, **kwargs)


def _host_isend(tensor, *args, **kwargs):
    return _isend(tensor.detach().cpu() if tensor.is_cuda else tensor, *args, **kwargs)


class _HostRecv:
    def __init__(self, work, host, dest):
        self.work, self.host, self.dest = work, host, dest

    def wait(self, *args, **kwargs):
        self.work.wait(*args, **kwargs)
        self.dest.copy_(self.host)
        return True

    def is_completed(self):
        return self.work.is_completed()


def _host_irecv(tensor, *args, **kwargs):
    if not tensor.is_cuda:
        return _irecv(tensor, *args, **kwargs)
    host = torch.empty_like(tensor, device="cpu")
    return _HostRecv(_irecv(host, *args, **kwargs), host, tensor)


def _host_recv(tensor, *args, **kwargs):
    if not tensor.is_cuda:
        return _recv(tensor, *args, **kwargs)
    host = torch.empty_like(tensor, device="cpu")
    src = _recv(host, *args, **kwargs)
    tensor.copy_(host)
    return src


dist.init_process_group, dist.isend, dist.irecv, dist.recv = _gloo, _host_isend, _host_irecv, _host_recv
'''


def _config(path: Path, *, data: int, pipeline: int, microbatches: int, steps: int, seq_len: int,
            schedule: str = "1F1B", preset: str = "debug") -> Path:
    path.write_text(json.dumps({"apiVersion": "spectrain.io/v1alpha1", "kind": "SpecTrainJob",
                                "metadata": {"name": "bench"}, "spec": {"mode": "Pretrain", "seed": 1, "target": {
                                    "image": "x", "nodes": data * pipeline, "procsPerNode": 1,
                                    "parallelism": {"data": data, "pipeline": pipeline, "microbatches": microbatches,
                                                    "schedule": schedule},
                                    "model": {"preset": preset},
                                    "data": {"source": "builtin:python-stdlib", "seqLen": seq_len,
                                             "batchSize": 2 * microbatches},
                                    "steps": steps, "checkpoint": {"everySteps": 10_000, "keep": 1}}}}))
    return path


def _shared_gpu_env(root: Path, world: int) -> dict[str, str]:
    """On CUDA with fewer GPUs than ranks: a PYTHONPATH whose sitecustomize is `_SHARED_GPU`."""
    if DEVICE != "cuda":
        return {}
    import torch

    if torch.cuda.device_count() >= world:
        return {}
    site = root / "shared-gpu"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SHARED_GPU)
    paths = (str(site), str(Path(__file__).resolve().parents[1] / "workloads"), os.environ.get("PYTHONPATH"))
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _run(root: Path, cfg: Path, world: int, env: dict[str, str]) -> Path:
    env = {"SPECTRAIN_DATA_MAX_BYTES": str(1 << 20), **_shared_gpu_env(root, world), **env}
    procs = launch_local(cfg, world, root, root / "ring", device=DEVICE, env=env)
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
    return [{**w, "rank": r} for r in range(world) for w in _read(root, f"windows-rank-{r}.jsonl")
            if w["step"] >= WARMUP]


def _bubble_fraction(root: Path, p: int, *, instrumented_only: bool = False) -> float:
    """`instrumented_only`: an interleaved run, whose plain steps have no windows."""
    fr = []
    for r in range(p):
        idle = sum(w["actual_ns"] for w in _read(root, f"windows-rank-{r}.jsonl")
                   if w["kind"] == "Bubble" and w["step"] >= WARMUP) / 1e9
        steps = [s for s in _read(root, f"target-rank-{r}.jsonl")[WARMUP:] if s["instrumented"] or not instrumented_only]
        fr.append(idle / (sum(s["pipeline_ms"] for s in steps) / 1e3))
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


def _hindsight_constant_error(ws: list[dict[str, Any]], prefix: str = "") -> float:
    """The median relative error if every transfer key (rank, channel, size, microbatch) were
    predicted by the one constant that, chosen in hindsight from all of that key's durations in the
    run, gives the lowest median error over them: how much of the durations' spread a prediction from
    a key's own history cannot remove. Not a bound for predictors that use the current step (the DDP
    buckets' lag does), but the scale of the noise they work against."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for w in ws:
        if w["kind"] == "Communication" and w.get("channel", "").startswith(prefix) and w["actual_ns"] > 0:
            groups.setdefault((w["rank"], w["channel"], w["bytes"], w.get("pos")), []).append(w["actual_ns"])
    errs: list[float] = []
    for xs in groups.values():
        best = min(xs, key=lambda c: median([abs(c - x) / x for x in xs]))
        errs += [abs(best - x) / x for x in xs]
    return median(errs)


def _accuracy(ws: list[dict[str, Any]], suffix: str) -> dict[str, float]:
    """Comm prediction errors pooled and per channel family, each with its hindsight-constant reference."""
    res = {f"pred_error_median_comm{suffix}": median(_errors(ws, "Communication")),
           f"pred_error_hindsight_comm{suffix}": _hindsight_constant_error(ws)}
    for name, prefix in (("dp_bucket", "dp-bucket"), ("pp_send", "pp-send"), ("pp_recv", "pp-recv")):
        errs = _errors(ws, "Communication", prefix)
        if errs:
            res[f"pred_error_median_comm_{name}{suffix}"] = median(errs)
            res[f"pred_error_hindsight_comm_{name}{suffix}"] = _hindsight_constant_error(ws, prefix)
    return res


def _interleaved(base: Path, name: str, preset: str, steps: int, bucket_cap_mb: str) -> tuple[Path, dict[str, float]]:
    """The interleaved overhead run (p=2 m=4): ratio of the median step periods and the step periods."""
    root = _run(base / name, _config(base / f"{name}.json", data=1, pipeline=2, microbatches=4, steps=steps,
                                     seq_len=SEQ, preset=preset),
                2, {"SPECTRAIN_INSTRUMENT_INTERLEAVE": str(INTERLEAVE), "SPECTRAIN_BUCKET_CAP_MB": bucket_cap_mb})
    periods = _periods(root, 2)
    return root, {"ratio": _interleaved_ratio(periods), "steps": len(periods),
                  "on_ms": median([t for f, t in periods if f]) * 1e3,
                  "off_ms": median([t for f, t in periods if not f]) * 1e3}


def _small(base: Path, quick: bool) -> dict[str, Any]:
    """The goal keys on the `small` preset (why this model: the module docstring): the interleaved
    overhead run, its bubble and pipeline-transfer windows, and a data=2 run's DDP buckets."""
    res: dict[str, Any] = {}
    root, il = _interleaved(base, "small-interleaved", "small", 16 if quick else 300, SMALL_BUCKET_MB)
    res["instrumentation_overhead_ratio"] = il["ratio"]
    res["instrumentation_overhead_steps"] = il["steps"]
    res["step_period_ms_instrumented_median"] = il["on_ms"]
    res["step_period_ms_plain_median"] = il["off_ms"]
    res["bubble_fraction_measured_small_p2_m4"] = _bubble_fraction(root, 2, instrumented_only=True)
    rdp = _run(base / "small-dp", _config(base / "small-dp.json", data=2, pipeline=1, microbatches=2,
                                          steps=8 if quick else 40, seq_len=SEQ, preset="small"),
               2, {"SPECTRAIN_BUCKET_CAP_MB": SMALL_BUCKET_MB})
    ws = _windows(root, 2) + _windows(rdp, 2)
    res["pred_error_median_bubble"] = median(_errors(ws, "Bubble"))
    res.update(_accuracy(ws, ""))
    return res


def _debug(base: Path, quick: bool) -> dict[str, Any]:
    """The same keys on the `debug` preset (`_debug`), the ABBA whole-run ratio, the cost fraction,
    and the bubble fractions against the formula for (2, 4), (4, 8) and Interleaved1F1B (2, 4)."""
    steps, blocks = (12, 1) if quick else (40, 3)
    env = {"SPECTRAIN_BUCKET_CAP_MB": DEBUG_BUCKET_MB}
    res: dict[str, Any] = {}
    cfg24 = _config(base / "p2m4.json", data=1, pipeline=2, microbatches=4, steps=steps, seq_len=SEQ)
    on_runs, on_t, off_t, ratios, ratios_p10, costs, costs_wall = [], [], [], [], [], [], []
    for i in range(blocks):   # ABBA: on off off on, then off on on off
        order = ["on", "off", "off", "on"] if i % 2 == 0 else ["off", "on", "on", "off"]
        meds: dict[str, list[float]] = {"on": [], "off": []}
        lows: dict[str, list[float]] = {"on": [], "off": []}
        for j, name in enumerate(order):
            root = base / f"{name}-{i}-{j}"
            run_env = {**env, "SPECTRAIN_INSTRUMENT": "1" if name == "on" else "0"}
            if name == "on":
                run_env["SPECTRAIN_INSTRUMENT_COST_FILE"] = str(root / "cost")
            r = _run(root, cfg24, 2, run_env)
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
    res["instrumentation_overhead_ratio_runs_debug"] = median(ratios)
    res["instrumentation_overhead_ratios_runs_debug"] = [round(x, 4) for x in ratios]
    res["instrumentation_overhead_ratio_runs_p10_debug"] = median(ratios_p10)
    res["instrumentation_cost_fraction_debug"] = median(costs)
    res["instrumentation_cost_fraction_max_debug"] = max(costs)
    res["instrumentation_cost_fraction_wall_debug"] = median(costs_wall)
    _, il = _interleaved(base, "interleaved", "debug", 100 if quick else 3000, DEBUG_BUCKET_MB)
    res["instrumentation_overhead_ratio_debug"] = il["ratio"]
    res["instrumentation_overhead_steps_debug"] = il["steps"]
    res["step_period_ms_instrumented_median_debug"] = il["on_ms"]
    res["step_period_ms_plain_median_debug"] = il["off_ms"]
    res["bubble_fraction_measured_p2_m4"] = statistics.mean(_bubble_fraction(r, 2) for r in on_runs)
    res["bubble_fraction_formula_p2_m4"] = 1 / 5
    cfg48 = _config(base / "p4m8.json", data=1, pipeline=4, microbatches=8, steps=steps, seq_len=SEQ // 2)
    r48 = _run(base / "p4m8", cfg48, 4, env)
    res["bubble_fraction_measured_p4_m8"] = _bubble_fraction(r48, 4)
    res["bubble_fraction_formula_p4_m8"] = 3 / 11
    cfg_il = _config(base / "il.json", data=1, pipeline=2, microbatches=4, steps=steps, seq_len=SEQ,
                     schedule="Interleaved1F1B")
    r_il = _run(base / "il", cfg_il, 2, env)
    res["bubble_fraction_measured_interleaved_p2_m4"] = _bubble_fraction(r_il, 2)
    res["bubble_fraction_formula_interleaved_p2_m4"] = 1 / 9      # (p-1)/(v*m+p-1), v = 2 chunks
    res["pred_error_median_bubble_interleaved_debug"] = median(_errors(_windows(r_il, 2), "Bubble"))
    res["bubble_fraction_measured"] = res["bubble_fraction_measured_p2_m4"]
    res["bubble_fraction_formula"] = res["bubble_fraction_formula_p2_m4"]
    cfg_dp = _config(base / "dp.json", data=2, pipeline=1, microbatches=2, steps=steps, seq_len=SEQ)
    rdp = _run(base / "dp", cfg_dp, 2, env)
    ws = [w for r in on_runs for w in _windows(r, 2)] + _windows(rdp, 2)
    res["pred_error_median_bubble_debug"] = median(_errors(ws + _windows(r48, 4), "Bubble"))
    res.update(_accuracy(ws, "_debug"))
    res["step_time_ms_on_median_debug"] = median(on_t) * 1e3
    res["step_time_ms_off_median_debug"] = median(off_t) * 1e3
    return res


def main() -> None:
    args = parse_args(__doc__ or "")
    with tempfile.TemporaryDirectory(prefix="bench-target-") as tmp:
        res = _small(Path(tmp), args.quick)
        if DEVICE == "cpu":
            res.update(_debug(Path(tmp), args.quick))
    name = "target" if DEVICE == "cpu" else "target_gpu"
    write_results(name, res, args.quick)
    print_table(f"bench-{name}" + (" (quick)" if args.quick else ""), res)


if __name__ == "__main__":
    main()
