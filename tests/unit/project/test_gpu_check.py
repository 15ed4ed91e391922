"""scripts/gpu_check.py (`make gpu-check`): its no-CUDA path for real, and its budget, key and goal logic
with real subprocesses (the GPU path itself runs only on a machine with a GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod      # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


gc = _load()


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _run_script(out: Path, *extra: str, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    paths = (pythonpath, "operator", "workloads", ".")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _assert_dry(out: Path, proc: subprocess.CompletedProcess[str], why: str) -> dict:
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "gpu.json").read_text())
    assert report["cuda"] is False
    names = [c.name for c in gc.default_checks()]
    assert set(report["checks"]) == set(names)
    for name, check in report["checks"].items():
        assert check["status"] == "skipped" and check["reason"], name
        assert why in check["reason"], check["reason"]
        assert name in proc.stdout
    assert "check" in proc.stdout and "status" in proc.stdout and "goals:" in proc.stdout
    assert set(report["goals"]) == set(gc.GOALS)
    assert all(g["met"] is False and g["value"] is None for g in report["goals"].values())
    assert (out / "gpu.log").exists()
    return report


@pytest.mark.skipif(_cuda(), reason="this machine has CUDA: the script would run the real checks (minutes)")
def test_without_cuda_every_check_is_skipped_and_gpu_json_says_so(tmp_path: Path) -> None:
    proc = _run_script(tmp_path)
    report = _assert_dry(tmp_path, proc, "no CUDA")
    assert report["torch"] is not None      # this venv has (CPU) torch: the reason is is_available()
    assert "is_available() is False" in report["checks"]["target"]["reason"]


def test_without_torch_the_reason_says_torch_is_not_importable(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "torch.py").write_text("raise ImportError('no torch in this python')\n")
    out = tmp_path / "out"
    report = _assert_dry(out, _run_script(out, pythonpath=str(shadow)), "torch not importable")
    assert report["torch"] is None and report["device"] is None


def test_dry_run_flag_skips_everything_and_only_selects_checks(tmp_path: Path) -> None:
    proc = _run_script(tmp_path, "--dry-run", "--only", "target,rl")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["dry_run"] is True and set(report["checks"]) == {"target", "rl"}
    assert all(c["status"] == "skipped" for c in report["checks"].values())
    bad = _run_script(tmp_path, "--only", "nope")
    assert bad.returncode == 2 and "unknown check" in bad.stderr


def _sleeper(name: str, budget_s: float, pid_file: Path) -> object:
    # leaves a grandchild behind, as a bench leaves ranks or a drafter: the whole group must die
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(5)")
    return gc.Check(name, (sys.executable, "-c", code), budget_s)


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_check_over_its_budget_times_out_and_the_next_one_still_runs(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    writes = "import json, sys; json.dump({'x': 1.5, 'other': 2}, open(sys.argv[1] + '/r.json', 'w'))"
    checks = [_sleeper("slow", 1.0, pid_file),
              gc.Check("fast", (sys.executable, "-c", writes, "{scratch}"), 30,
                       collect=lambda d: gc.map_keys(json.loads((d / "r.json").read_text()), {"x": "x_gpu"})),
              gc.Check("broken", (sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"), 30)]
    seen: list[str] = []
    t0 = time.monotonic()
    res = gc.run_checks(checks, env=os.environ, budget_s=60, scratch=tmp_path / "s", log=tmp_path / "gpu.log",
                        modules={}, on_result=lambda n, r: seen.append(n))
    assert time.monotonic() - t0 < 15
    assert res["slow"].status == "timeout" and 1.0 <= res["slow"].seconds < 4.5
    assert _gone(int(pid_file.read_text())), "the timed-out check's grandchild survived"
    assert res["fast"].status == "ok" and res["fast"].keys == {"x_gpu": 1.5}
    assert res["broken"].status == "failed"
    assert "exit 3" in res["broken"].reason and "boom" in res["broken"].reason
    assert seen == ["slow", "fast", "broken"]
    log = (tmp_path / "gpu.log").read_text()
    assert "==== slow" in log and "==== broken" in log and "boom" in log


def test_no_check_starts_once_the_total_budget_is_spent(tmp_path: Path) -> None:
    checks = [_sleeper("first", 1.0, tmp_path / "pid"),
              gc.Check("second", (sys.executable, "-c", "pass"), 30)]
    res = gc.run_checks(checks, env=os.environ, budget_s=1.5, scratch=tmp_path / "s",
                        log=tmp_path / "gpu.log", modules={})
    assert res["first"].status == "timeout"
    assert res["second"].status == "skipped" and "total budget" in res["second"].reason


def test_check_timeout_is_cut_to_what_is_left() -> None:
    assert gc.check_timeout(90, 400) == 90
    assert gc.check_timeout(90, 30) == 30
    assert gc.check_timeout(90, 5) is None           # under MIN_START_S: not started
    assert gc.check_timeout(1, 1.5) == 1            # a check shorter than MIN_START_S still fits


def test_missing_packages_and_static_skips_are_reported(tmp_path: Path) -> None:
    checks = [gc.Check("needy", (sys.executable, "-c", "pass"), 10, needs=("numpy", "no_such_module")),
              gc.Check("later", (), 10, skip="does not exist yet")]
    res = gc.run_checks(checks, env=os.environ, budget_s=60, scratch=tmp_path, log=tmp_path / "gpu.log",
                        modules={"numpy": True, "no_such_module": False})
    assert res["needy"].status == "skipped" and res["needy"].reason.endswith(": no_such_module")
    assert res["later"].status == "skipped" and res["later"].reason == "does not exist yet"


@pytest.mark.skipif(shutil.which(gc.MPS_CONTROL) is not None, reason="this machine has MPS")
def test_an_mps_check_without_the_mps_binary_is_skipped(tmp_path: Path) -> None:
    checks = [gc.Check("mps", (sys.executable, "-c", "pass"), 10, mps=True)]
    res = gc.run_checks(checks, env=os.environ, budget_s=60, scratch=tmp_path, log=tmp_path / "gpu.log",
                        modules={})
    assert res["mps"].status == "skipped" and gc.MPS_CONTROL in res["mps"].reason


def test_bench_keys_map_this_runs_results_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "RESULTS", tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    collect = gc.bench_keys("harvest_gpu", gc.suffixed(gc.SHARING_KEYS, "_gpu"))
    (tmp_path / "harvest_gpu.json").write_text(json.dumps({"harvest_efficiency": 0.9, "overrun_p99_ms": 1.0}))
    (scratch / "started").write_text(repr(time.time() + 60))      # the file predates this check: stale
    with pytest.raises(FileNotFoundError):
        collect(scratch)
    (scratch / "started").write_text(repr(time.time() - 60))
    assert collect(scratch) == {"harvest_efficiency_gpu": 0.9, "overrun_p99_ms_gpu": 1.0}
    (tmp_path / "harvest_gpu.json").write_text(json.dumps({"unrelated": 1}))
    with pytest.raises(KeyError):
        collect(scratch)


def test_map_keys_and_goals() -> None:
    assert gc.map_keys({"a": 1, "b": 2}, {"a": "a_gpu", "c": "c_gpu"}) == {"a_gpu": 1}
    goals = gc.evaluate_goals({"target_slowdown_ratio_gpu": 1.004, "harvest_efficiency_gpu": 0.7})
    assert goals["target_slowdown_ratio_gpu"] == {"goal": "<= 1.01", "value": 1.004, "met": True}
    assert goals["harvest_efficiency_gpu"]["met"] is False
    assert goals["pred_error_median_comm_gpu"] == {"goal": "<= 0.2", "value": None, "met": False}


def test_junit_counts_and_all_skipped(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure message="x"/></testcase>'
        '<testcase name="c"><skipped message="no MPS"/></testcase></testsuite></testsuites>')
    assert gc.junit_keys(tmp_path) == {"tests_gpu_passed": 1, "tests_gpu_failed": 1, "tests_gpu_skipped": 1}
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase name="c"><skipped message="nvidia-cuda-mps-control not on PATH"/>'
        '</testcase></testsuite></testsuites>')
    with pytest.raises(gc.CheckSkipped, match="not on PATH"):
        gc.junit_keys(tmp_path)
