"""`make gpu-check`: every CUDA path of spectrain in one prepared run on a machine with one NVIDIA GPU.

It uses that machine's own python3 and PyTorch (nothing is installed; the sources go on PYTHONPATH).
Each check is a subprocess in its own process group with its own wall-clock budget: one that overruns
is killed, group and all (ranks, drafter), and recorded as "timeout", and the next one starts. No check
starts once the total budget (--budget-s, 480 s) is spent. A check whose optional packages are missing
in this python is skipped with a line naming them. Without CUDA every check is skipped with the reason,
gpu.json says "cuda": false, and the exit status is 0.

Writes <out>/gpu.json (atomically, after every check, so an interrupted run keeps what it measured) and
<out>/gpu.log (each check's output); <out> is bench/results unless --out says otherwise. The benches
run with SPECTRAIN_DEVICE=cuda and write bench/results/<bench>_gpu.json, which their keys are read from.

    PYTHONPATH=operator:workloads:. python3 scripts/gpu_check.py [--only target,rl] [--budget-s 480]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TOTAL_BUDGET_S = 480.0
MIN_START_S = 10.0        # a check is not started with less than this (or its own budget) left
RESERVE_S = 5.0           # of the total: killing an overrunning check's group, writing the results
MPS_CONTROL = "nvidia-cuda-mps-control"
GOALS: dict[str, tuple[str, float]] = {
    "target_slowdown_ratio_gpu": ("<=", 1.01),      # measured under MPS (sharing-mps)
    "harvest_efficiency_gpu": (">=", 0.8),
    "pred_error_median_comm_gpu": ("<=", 0.2),
}


class CheckSkipped(Exception):
    """Raised while preparing or reading a check: it did not (really) run, for this reason."""


@dataclass(frozen=True)
class Check:
    name: str
    argv: tuple[str, ...]                  # "{scratch}" is replaced by the check's own scratch directory
    budget_s: float
    needs: tuple[str, ...] = ()            # modules this python must have (besides torch)
    env: Mapping[str, str] = field(default_factory=dict)
    mps: bool = False                      # run as clients of a private MPS daemon
    collect: Callable[[Path], dict[str, Any]] | None = None   # scratch dir -> keys
    skip: str | None = None                # why it cannot run anywhere (yet)


@dataclass
class Result:
    status: str                            # ok | skipped | failed | timeout
    seconds: float = 0.0
    reason: str = ""
    keys: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------ reading results

def map_keys(results: Mapping[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    """The mapped keys present in a bench's results, under their gpu.json names."""
    return {new: results[old] for old, new in mapping.items() if old in results}


def suffixed(keys: list[str], suffix: str) -> dict[str, str]:
    return {k: k + suffix for k in keys}


def bench_keys(name: str, mapping: Mapping[str, str]) -> Callable[[Path], dict[str, Any]]:
    """Collector for a bench: its bench/results/<name>.json, if written since the check started."""
    def collect(scratch: Path) -> dict[str, Any]:
        path = RESULTS / f"{name}.json"
        if not path.exists() or path.stat().st_mtime < float((scratch / "started").read_text()):
            raise FileNotFoundError(f"{path} was not written by this run")
        keys = map_keys(json.loads(path.read_text()), mapping)
        if not keys:
            raise KeyError(f"none of {sorted(mapping)} in {path}")
        return keys
    return collect


def junit_counts(prefix: str) -> Callable[[Path], dict[str, Any]]:
    """`<prefix>_{passed,failed,skipped}` from pytest's junit XML; all skipped (e.g. no MPS binary) ->
    CheckSkipped."""
    def collect(scratch: Path) -> dict[str, Any]:
        cases = list(ET.parse(scratch / "junit.xml").getroot().iter("testcase"))
        failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
        skips = [s for c in cases if (s := c.find("skipped")) is not None]
        if cases and len(skips) == len(cases):
            raise CheckSkipped("; ".join(sorted({s.get("message", "") for s in skips})) or "every test skipped")
        return {f"{prefix}_passed": len(cases) - failed - len(skips), f"{prefix}_failed": failed,
                f"{prefix}_skipped": len(skips)}
    return collect


junit_keys = junit_counts("tests_gpu")     # tests/gpu but the HF files (their own check, hf-bf16)


def nvml_keys(scratch: Path) -> dict[str, Any]:
    """What the operator's status shows of a node (nvml.report()), as this process sees it."""
    r = json.loads((scratch / "nvml.json").read_text())
    if not r["available"]:
        raise RuntimeError(f"NVML not available: {r['reason']}")
    shown = ("name", "compute_mode", "memory_total_bytes", "utilization_gpu_pct")
    return {"nvml_driver_version": r["driver_version"], "nvml_mps": r["mps"],
            "nvml_gpus": [{k: g[k] for k in shown} for g in r["gpus"]]}


NVML_REPORT = ("import json, os, sys; from spectrain_workloads import nvml; "
               "r = json.dumps(nvml.report().to_dict()); "
               "open(os.path.join(sys.argv[1], 'nvml.json'), 'w').write(r); print(r)")
SHARING_KEYS = ["target_slowdown_ratio", "harvest_efficiency", "overrun_p99_ms", "drafter_microstep_ms",
                "acceptance_ratio"]
TARGET_KEYS = ["pred_error_median_bubble", "pred_error_median_comm", "instrumentation_overhead_ratio",
               "pred_error_hindsight_comm", "pred_error_median_comm_dp_bucket",
               "pred_error_median_comm_pp_send", "pred_error_median_comm_pp_recv",
               "bubble_fraction_measured_small_p2_m4"]
ROLLOUT_KEYS = ["speedup_bs1", "speedup_bs4", "speedup_bs16", "speedup_bs64", "min_speedup",
                "acceptance_length", "cuda_graphs_captured", "greedy_rows_identical",
                "speedup_bs1_t1", "speedup_bs4_t1", "speedup_bs16_t1", "speedup_bs64_t1", "min_speedup_t1",
                "acceptance_length_t1", "cuda_graphs_captured_t1"]
HF_TESTS = ("tests/gpu/test_hf_cuda.py", "tests/gpu/test_eagle3_cuda.py")   # HF targets in bf16, EAGLE-3 included


def default_checks(python: str = sys.executable) -> list[Check]:
    """The checks, most wanted first: with little time left, the later ones are the ones left out."""
    cuda = {"SPECTRAIN_DEVICE": "cuda"}
    pytest = (python, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
              "--junitxml={scratch}/junit.xml", *(f"--ignore={t}" for t in HF_TESTS))
    hf = (python, "-m", "pytest", *HF_TESTS, "-m", "gpu", "-q", "-rs", "-s", "-p", "no:cacheprovider",
          "--junitxml={scratch}/junit.xml")
    harvest = (python, "-m", "bench.harvest", "--quick")
    return [
        Check("nvml", (python, "-c", NVML_REPORT, "{scratch}"), 15, needs=("pynvml",), collect=nvml_keys),
        Check("tests-gpu", pytest, 70, needs=("pytest", "numpy"), collect=junit_keys),
        Check("sharing-mps", harvest, 95, needs=("numpy", "safetensors"), env=cuda, mps=True,
              collect=bench_keys("harvest_gpu", suffixed(SHARING_KEYS, "_gpu"))),
        Check("target", (python, "-m", "bench.target"), 85, needs=("numpy",), env=cuda,
              collect=bench_keys("target_gpu", suffixed(TARGET_KEYS, "_gpu"))),
        Check("rollout", (python, "-m", "bench.rollout"), 120, needs=("numpy",), env=cuda,
              collect=bench_keys("rollout_gpu", suffixed(ROLLOUT_KEYS, "_gpu"))),
        Check("rl", (python, "-m", "bench.rl", "--quick"), 60, needs=("numpy",), env=cuda,
              collect=bench_keys("rl_gpu", {"rl_step_speedup": "rl_step_speedup_gpu",
                                            "rollout_speedup": "rl_rollout_speedup_gpu"})),
        Check("sharing-nomps", harvest, 85, needs=("numpy", "safetensors"), env=cuda,
              collect=bench_keys("harvest_gpu", suffixed(SHARING_KEYS, "_gpu_nomps"))),
        Check("hf-bf16", hf, 120, needs=("pytest", "transformers"), collect=junit_counts("hf_bf16_tests")),
    ]


def evaluate_goals(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for key, (op, bound) in GOALS.items():
        v = flat.get(key)
        met = isinstance(v, (int, float)) and (v <= bound if op == "<=" else v >= bound)
        out[key] = {"goal": f"{op} {bound}", "value": v, "met": bool(met)}
    return out


# ------------------------------------------------------------------------------------- running

def check_timeout(budget_s: float, remaining_s: float) -> float | None:
    """A check's timeout: its own budget cut to what is left of the total; None: too little left to start."""
    t = min(budget_s, remaining_s)
    return t if t >= min(MIN_START_S, budget_s) else None


def _kill_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(2.0 if sig == signal.SIGTERM else 0.0)


def run_process(argv: list[str], env: Mapping[str, str], timeout_s: float, output: Path) -> int | None:
    """Exit status, None if it timed out. The process leads a new group: whatever it started dies with it."""
    with open(output, "ab") as out:
        proc = subprocess.Popen(argv, env=dict(env), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        _kill_group(proc.pid)           # a timed-out check, or what a finished one left behind
        proc.wait()
    return rc


@contextmanager
def mps_daemon(scratch: Path, env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """A private MPS control daemon (pipe and log under scratch); its clients get the returned env."""
    binary = shutil.which(MPS_CONTROL, path=env.get("PATH"))
    if binary is None:
        raise CheckSkipped(f"{MPS_CONTROL} not on PATH: no MPS on this machine")
    pipe, log = scratch / "mps-pipe", scratch / "mps-log"
    pipe.mkdir()
    log.mkdir()
    menv = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    start = subprocess.run([binary, "-d"], env=menv, capture_output=True, text=True, timeout=30)
    if start.returncode != 0:
        said = (start.stderr or start.stdout).strip()
        raise CheckSkipped(f"{MPS_CONTROL} -d could not be started (exit {start.returncode}): {said}")
    try:
        deadline = time.monotonic() + 20
        while subprocess.run([binary], input="get_server_list\n", env=menv, capture_output=True, text=True,
                             timeout=10).returncode != 0:
            if time.monotonic() > deadline:
                said = (log / "control.log").read_text()[-300:] if (log / "control.log").exists() else ""
                raise CheckSkipped(f"the MPS control daemon did not answer within 20 s {said}".strip())
            time.sleep(0.2)
        yield menv
    finally:
        subprocess.run([binary], input="quit\n", env=menv, capture_output=True, text=True, timeout=30)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def run_check(check: Check, *, env: Mapping[str, str], timeout_s: float, scratch: Path, log: Path) -> Result:
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "started").write_text(repr(time.time()))
    output = scratch / "output.log"
    t0 = time.monotonic()
    argv = [a.replace("{scratch}", str(scratch)) for a in check.argv]
    try:
        with mps_daemon(scratch, env) if check.mps else nullcontext(env) as cenv:
            rc = run_process(argv, {**cenv, **check.env}, timeout_s, output)
    except CheckSkipped as e:
        return Result("skipped", time.monotonic() - t0, str(e))
    seconds = time.monotonic() - t0
    text = output.read_text(errors="replace") if output.exists() else ""
    with open(log, "a") as f:
        f.write(f"\n==== {check.name}: {' '.join(argv)[:300]}\n{text}")
    if rc is None:
        return Result("timeout", seconds, f"killed after {timeout_s:.0f} s; last line: {_last_line(text)}")
    keys: dict[str, Any] = {}
    try:
        keys = check.collect(scratch) if check.collect else {}
    except CheckSkipped as e:
        if rc == 0:
            return Result("skipped", seconds, str(e))
    except Exception as e:      # results missing or unreadable; after a failure the output says why
        if rc == 0:
            return Result("failed", seconds, f"no results: {type(e).__name__}: {e}")
    if rc != 0:
        return Result("failed", seconds, f"exit {rc}: {_last_line(text)}", keys)
    return Result("ok", seconds, "", keys)


def run_checks(checks: list[Check], *, env: Mapping[str, str], budget_s: float, scratch: Path, log: Path,
               modules: Mapping[str, bool], on_result: Callable[[str, Result], None] | None = None
               ) -> dict[str, Result]:
    t0 = time.monotonic()
    results: dict[str, Result] = {}
    for check in checks:
        missing = [m for m in check.needs if not modules.get(m)]
        timeout = check_timeout(check.budget_s, budget_s - (time.monotonic() - t0))
        if check.skip:
            res = Result("skipped", reason=check.skip)
        elif missing:
            res = Result("skipped", reason=f"optional package(s) not in this python: {', '.join(missing)}")
        elif timeout is None:
            res = Result("skipped", reason=f"total budget of {budget_s:.0f} s spent")
        else:
            print(f"[gpu-check] {check.name}: running (up to {timeout:.0f} s)", flush=True)
            res = run_check(check, env=env, timeout_s=timeout, scratch=scratch / check.name, log=log)
        results[check.name] = res
        if on_result:
            on_result(check.name, res)
    return results


# ------------------------------------------------------------------------------------- reporting

PROBE = """
import importlib.util, json, sys
out = {"python": sys.version.split()[0], "torch": None, "cuda": False, "device": None, "reason": "",
       "modules": {m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}}
try:
    import torch
except Exception as e:
    out["reason"] = f"torch not importable ({type(e).__name__}: {e})"
else:
    out["torch"] = torch.__version__
    out["cuda"] = bool(torch.cuda.is_available())
    if out["cuda"]:
        out["device"] = torch.cuda.get_device_name(0)
    else:
        out["reason"] = f"torch {torch.__version__}: torch.cuda.is_available() is False"
print(json.dumps(out))
"""


def probe(python: str, env: Mapping[str, str], modules: list[str]) -> dict[str, Any]:
    """torch, CUDA, the device and which optional modules this python has (a subprocess: CUDA init)."""
    try:
        r = subprocess.run([python, "-c", PROBE, *modules], env=dict(env), capture_output=True, text=True,
                           timeout=120)
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return {"python": None, "torch": None, "cuda": False, "device": None, "modules": {},
                "reason": f"probe failed: {type(e).__name__}"}


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def table(results: Mapping[str, Result], goals: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [f"{'check':<14} {'status':<8} {'seconds':>7}  keys / reason", "-" * 100]
    for name, r in results.items():
        detail = ", ".join(f"{k}={_short(v)}" for k, v in r.keys.items()) or r.reason
        if r.keys and r.reason:
            detail += f" ({r.reason})"
        wrapped = textwrap.wrap(detail, 70) or [""]
        lines.append(f"{name:<14} {r.status:<8} {r.seconds:>7.1f}  {wrapped[0]}")
        lines += [" " * 33 + w for w in wrapped[1:]]
    lines.append("goals:")
    for key, g in goals.items():
        verdict = "met" if g["met"] else "not met"
        shown = "not measured" if g["value"] is None else f"{_short(g['value'])}, {verdict}"
        lines.append(f"  {key} {g['goal']}: {shown}")
    return "\n".join(lines)


def report(meta: Mapping[str, Any], results: Mapping[str, Result]) -> dict[str, Any]:
    flat = {k: v for r in results.values() for k, v in r.keys.items()}
    checks = {n: asdict(r) for n, r in results.items()}
    return {**meta, "checks": checks, **flat, "goals": evaluate_goals(flat)}


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def check_env() -> dict[str, str]:
    """This environment with the sources on PYTHONPATH, as absolute paths."""
    paths = [str(REPO / "operator"), str(REPO / "workloads"), str(REPO)]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + extra), "PYTHONUNBUFFERED": "1"}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="where gpu.json and gpu.log go (bench/results)")
    ap.add_argument("--only", default="", help="comma-separated check names (reruns)")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="total wall-clock budget")
    ap.add_argument("--dry-run", action="store_true", help="skip every check, as on a machine without CUDA")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    checks = default_checks()
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = sorted(wanted - {c.name for c in checks})
        if unknown:
            ap.error(f"unknown check(s) {unknown}; known: {[c.name for c in checks]}")
        checks = [c for c in checks if c.name in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    gpu_json, log = args.out / "gpu.json", args.out / "gpu.log"
    env = check_env()
    found = probe(sys.executable, env, sorted({m for c in checks for m in c.needs}))
    log.write_text(f"gpu-check {_now()}\nprobe: {json.dumps(found)}\n")
    meta = {k: found[k] for k in ("cuda", "device", "torch", "python")}
    meta.update(dry_run=args.dry_run, budget_s=args.budget_s, timestamp=_now())
    print(f"gpu-check: cuda={found['cuda']} device={found['device']} torch={found['torch']}", flush=True)
    if args.dry_run or not found["cuda"]:
        why = "dry run (--dry-run)" if args.dry_run else f"no CUDA: {found['reason']}"
        results = {c.name: Result("skipped", reason=c.skip or why) for c in checks}
    else:
        done: dict[str, Result] = {}

        def keep(name: str, res: Result) -> None:
            done[name] = res
            print(f"[gpu-check] {name}: {res.status} ({res.seconds:.0f} s) {res.reason}".rstrip(), flush=True)
            write_json(gpu_json, report({**meta, "wall_s": time.monotonic() - t0}, done))

        left = args.budget_s - RESERVE_S - (time.monotonic() - t0)     # the probe's time counts too
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
            results = run_checks(checks, env=env, budget_s=left, scratch=Path(scratch), log=log,
                                 modules=found["modules"], on_result=keep)
    out = report({**meta, "wall_s": time.monotonic() - t0}, results)
    write_json(gpu_json, out)
    print("\n" + table(results, out["goals"]) + f"\n\nwrote {gpu_json} and {log}")
    return 1 if any(r.status in ("failed", "timeout") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
