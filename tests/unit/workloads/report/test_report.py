"""The report's figures from synthetic run directories (real files in the contracts.md layout):
idle / harvested / effective seconds per rank, exchange MB/s, final and peak acceptance, the RL
reward curve and the side-by-side speedup, and the rendered report and headline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spectrain_api import rundir
from spectrain_workloads import report
from spectrain_workloads.report.rl import window

pytestmark = pytest.mark.unit

MS = 1_000_000
S = 1_000_000_000
T0 = 1_000 * S          # CLOCK_MONOTONIC of the synthetic run's start


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def window_rec(wid: int, kind: str, start_ms: int, length_ms: int) -> dict[str, Any]:
    return {"window_id": wid, "kind": kind, "stage": 0, "step": 1, "start_ns": T0 + start_ms * MS,
            "predicted_ns": length_ms * MS, "actual_ns": length_ms * MS}


def work(wid: int, kind: str, start_ms: int, end_ms: int, busy_ms: int, *, window_end_ms: int | None) -> dict[str, Any]:
    return {"event": "work", "t_ns": T0 + end_ms * MS, "window_id": wid, "kind": kind,
            "start_ns": T0 + start_ms * MS, "end_ns": T0 + end_ms * MS, "busy_ns": busy_ms * MS,
            "busy_in_window_ns": busy_ms * MS if window_end_ms is not None else 0, "microsteps": 1,
            "window_end_ns": None if window_end_ms is None else T0 + window_end_ms * MS}


def event(name: str, t_ms: int, **fields: Any) -> dict[str, Any]:
    return {"event": name, "t_ns": T0 + t_ms * MS, **fields}


def pretrain_run(d: Path, *, summary0: dict[str, Any] | None = None) -> None:
    """Two ranks. Rank 0: no export, 40 ms harvested of 350 ms idle, the best acceptance measured.
    Rank 1 exports: 150 ms of work before the export it ends at, 100 ms after it (not in any export)."""
    m = d / "metrics"
    write_jsonl(m / "windows-rank-0.jsonl", [window_rec(1, "Bubble", 0, 100), window_rec(2, "Bubble", 200, 100),
                                             window_rec(3, "Bubble", 400, 100), window_rec(4, "Communication", 600, 50)])
    write_jsonl(rundir.drafter_metrics(d, 0), [
        event("state", 0, state="Waiting", reason="NoData"),
        work(1, "Bubble", 10, 50, 40, window_end_ms=100),
        work(-1, "Bubble", 700, 900, 200, window_end_ms=None),          # policy Always, outside windows: not idle time
        event("acceptance", 1000, acceptance_length=3.5),
        event("state", 2000, state="Active", reason=""),
    ])
    rundir.drafter_summary(d, 0).write_text(json.dumps(
        {"state": "Active", "reason": "", "artifact": "", "acceptanceLength": 3.5, "harvestEfficiency": 0.1,
         **(summary0 or {})}))
    write_jsonl(m / "windows-rank-1.jsonl", [window_rec(10, "Bubble", 0, 200), window_rec(11, "Bubble", 1000, 200)])
    write_jsonl(rundir.drafter_metrics(d, 1), [
        work(10, "Bubble", 10, 160, 150, window_end_ms=200),
        event("checkpoint", 300, version=1, artifact="/x/drafter/v1"),
        event("acceptance", 310, acceptance_length=2.0),
        event("checkpoint", 500, version=2, artifact="/x/drafter/v2"),
        event("acceptance", 600, acceptance_length=3.0),
        event("checkpoint", 900, version=2, artifact="/x/drafter/v2"),   # a checkpoint without a new export
        # the drafter never saw this window's end: its work is clipped to the end the target logged
        work(11, "Bubble", 1050, 1300, 250, window_end_ms=None),
        event("acceptance", 1400, acceptance_length=2.5),
    ])
    rundir.drafter_summary(d, 1).write_text(json.dumps(
        {"state": "Active", "artifact": "/x/drafter/v2", "acceptanceLength": 2.5, "harvestEfficiency": 0.5,
         "exportsRejectedByCause": {"below_latest": 3, "below_floor": 1, "non_finite": 0, "unmeasured": "x"},
         "combineAdjustedByCause": {"work_capped": 2, "outlier_clipped": -1, "weight_capped": True}}))
    for r in (0, 1):
        write_jsonl(m / f"target-rank-{r}.jsonl", [{"step": s, "loss": 5.0 - s, "step_time_s": 0.5,
                                                    "time_ns": T0 + s * S // 2} for s in range(4)])


def test_idle_harvested_and_effective_seconds_per_rank(tmp_path: Path) -> None:
    pretrain_run(tmp_path)
    s = report.summarize(tmp_path)
    r0, r1 = s["per_rank"]["0"], s["per_rank"]["1"]
    assert r0["idle_s_by_kind"]["Bubble"] == pytest.approx(0.3) and r0["idle_s_by_kind"]["Communication"] == pytest.approx(0.05)
    assert r0["harvested_s_by_kind"]["Bubble"] == pytest.approx(0.04)           # the unwindowed work is not harvest
    assert r1["harvested_s_by_kind"]["Bubble"] == pytest.approx(0.15 + 0.15)    # second: 1050 ms .. window end 1200 ms
    assert s["harvested_s_by_rank"] == pytest.approx({"0": 0.04, "1": 0.30})
    # Only the exporting rank's work before its current export reached the exported model.
    assert (r0["effective_s"], r0["exports"]) == (0.0, False)
    assert r1["effective_s"] == pytest.approx(0.15) and r1["exports"]
    assert s["idle_s"] == pytest.approx(0.35 + 0.4)
    assert s["effective_harvest_fraction"] == pytest.approx(0.15 / 0.75)
    assert s["harvested_s"] == pytest.approx(0.34) and s["harvest_efficiency"] == pytest.approx(0.3)
    assert r0["exchange_mb_per_s"] is None and r0["drafter"] == "Active"
    # final: the exporting drafter's newest measurement; peak: the best any drafter measured
    assert s["acceptance_length"] == 2.5 and s["acceptance_length_peak"] == 3.5
    assert s["artifact"] == "/x/drafter/v2" and s["steps"] == 4 and "reward_first" not in s
    assert s["exports_rejected_by_cause"] == {"below_latest": 3, "below_floor": 1, "non_finite": 0, "unmeasured": 0,
                                              "version_reused": 0}
    # counts that are not positive integers (a summary any drafter of the job writes) count nothing
    assert s["combine_adjusted_by_cause"] == {"work_capped": 2, "outlier_clipped": 0, "weight_capped": 0}


def test_combined_work_seconds_and_exchange_counters_are_used_when_the_drafter_reports_them(tmp_path: Path) -> None:
    # The fleet: rank 0's window work reaches the exported model through the combined version.
    pretrain_run(tmp_path, summary0={"combinedWorkSeconds": 0.1, "exchangeBytesSent": 3_000_000,
                                     "exchangeBytesReceived": 1_000_000, "usableSeconds": 0.3,
                                     "windowsVerifyOnly": 2})
    s = report.summarize(tmp_path)
    # the Communication window (50 ms) fitted no micro-step: 0.35 s idle, 0.3 s usable
    assert s["per_rank"]["0"]["unusable_s"] == pytest.approx(0.05)
    assert s["per_rank"]["0"]["windows_verify_only"] == 2 and s["per_rank"]["1"]["unusable_s"] is None
    assert any("too short 0.05 s, 2 windows verify-only" in line for line in report.headline(s))
    assert s["effective_s_by_rank"] == pytest.approx({"0": 0.1, "1": 0.15})
    assert s["effective_harvest_fraction"] == pytest.approx(0.25 / 0.75)
    assert s["per_rank"]["0"]["exchange_mb_per_s"] == pytest.approx(4.0 / 2.0)    # 4 MB over its 2 s of logs
    assert s["per_rank"]["1"]["exchange_mb_per_s"] is None


def test_the_coordinators_count_of_exported_work_covers_the_last_round(tmp_path: Path) -> None:
    # rank 0's own count misses the last round (combined after it stopped); the coordinator saw it
    pretrain_run(tmp_path, summary0={"combinedWorkSeconds": 0.1})
    s1 = json.loads(rundir.drafter_summary(tmp_path, 1).read_text())
    s1["exportWorkSecondsByRank"] = {"0": 0.3, "1": 0.05}
    rundir.drafter_summary(tmp_path, 1).write_text(json.dumps(s1))
    s = report.summarize(tmp_path)
    assert s["effective_s_by_rank"] == pytest.approx({"0": 0.3, "1": 0.15})    # the larger of the two counts


def test_combined_work_counts_only_its_share_inside_windows(tmp_path: Path) -> None:
    # Rank 0 was busy 0.08 s, 0.04 s of it inside windows (tasks ran past window ends): half of the
    # work it says reached the export was idle time, so half counts.
    pretrain_run(tmp_path, summary0={"combinedWorkSeconds": 0.06, "busySeconds": 0.08})
    s1 = json.loads(rundir.drafter_summary(tmp_path, 1).read_text())
    s1["exportWorkSecondsByRank"] = {"0": 0.07}
    rundir.drafter_summary(tmp_path, 1).write_text(json.dumps(s1))
    s = report.summarize(tmp_path)
    assert s["effective_s_by_rank"]["0"] == pytest.approx(0.07 * 0.5)
    assert s["effective_s_by_rank"]["0"] <= s["harvested_s_by_rank"]["0"]


def rl_run(d: Path, *, steps: int = 20, plain_every: int = 4) -> list[float]:
    """One rank of RL: reward rising linearly; every `plain_every`-th step measured side by side."""
    speedups = [1.2, 1.4, 1.3, 1.5, 1.1]
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": 0.1, "step_time_s": 1.0, "time_ns": T0 + s * S, "reward": 0.1 + 0.02 * s,
               "rollout_s": 0.8, "train_s": 0.2, "rollout_tokens_per_s": 100.0, "tokens": 80,
               "acceptance_length": 1.0 + s / 10 if s > 2 else 0.0, "spec_steps": 5 if s > 2 else 0,
               "plain_share": 1.0 if s <= 2 else 0.5, "k_histogram": {"0": 11} if s <= 2 else {"0": 7, "3": 4}}
        if plain_every and s % plain_every == 0:
            sp = speedups[(s // plain_every - 1) % len(speedups)]
            plain = sp * 1.0 - 0.2
            row.update(plain_rollout_s=plain, plain_rollout_tokens_per_s=80 / plain, rl_step_speedup=sp)
        rows.append(row)
    rows.append({**rows[4], "reward": 0.0})      # a resumed run repeating step 5: the last record wins
    rows[4] = {**rows[4], "reward": 99.0}
    write_jsonl(d / "metrics" / "target-rank-0.jsonl", rows)
    write_jsonl(d / "metrics" / "windows-rank-0.jsonl", [window_rec(s, "RolloutTail", s * 1000, 300)
                                                         for s in range(1, steps + 1)])
    write_jsonl(rundir.drafter_metrics(d, 0), [work(s, "RolloutTail", s * 1000, s * 1000 + 250, 200,
                                                    window_end_ms=s * 1000 + 300) for s in range(1, 4)])
    rundir.drafter_summary(d, 0).write_text(json.dumps({"state": "Active", "artifact": "/x/v1",
                                                        "acceptanceLength": 3.0}))
    return speedups


def test_rl_reward_curve_speedup_and_acceptance(tmp_path: Path) -> None:
    rl_run(tmp_path)
    s = report.summarize(tmp_path)
    assert window(20) == 5 and window(400) == 40 and window(3) == 1
    assert s["reward_window_steps"] == 5
    # step 5 counts with its last record (reward 0.0), not the first (99.0)
    assert s["reward_first"] == pytest.approx((0.12 + 0.14 + 0.16 + 0.18 + 0.0) / 5)
    assert s["reward_last"] == pytest.approx(0.1 + 0.02 * 18)
    assert s["reward_by_step"]["20"] == pytest.approx(0.5) and len(s["reward_by_step"]) == 20
    assert s["rl_step_speedup"] == pytest.approx(1.3) and s["rl_step_speedup_steps"] == 5
    assert s["rl_step_speedup_source"] == "side-by-side"
    assert s["rl_step_s"] == 1.0 and s["rl_step_s_plain"] == pytest.approx(1.3)
    assert s["rollout_tokens_per_s"] == 100.0 and s["plain_rollout_tokens_per_s"] == pytest.approx(80 / 1.1)
    assert s["rollout_speedup"] == pytest.approx(1.1 / 0.8)
    # acceptance of the rollouts over the steps that speculated (3..20)
    assert s["rollout_acceptance_first"] == pytest.approx(1.0 + (3 + 4 + 5 + 6 + 7) / 50)
    assert s["rollout_acceptance_last"] == pytest.approx(1.0 + 1.8)
    assert s["effective_harvest_fraction"] == pytest.approx(0.6 / 6.0)
    # the controller's decisions: plain share first / last 5 steps, steps per draft length over the run
    assert s["rollout_plain_share_first"] == pytest.approx((1 + 1 + 0.5 + 0.5 + 0.5) / 5)
    assert s["rollout_plain_share_last"] == pytest.approx(0.5)
    assert s["rollout_k_histogram"] == {"0": 2 * 11 + 18 * 7, "3": 18 * 4}


def test_rl_speedup_from_a_baseline_run_when_no_step_was_measured(tmp_path: Path) -> None:
    rl_run(tmp_path, plain_every=0)
    write_jsonl(tmp_path / "baseline" / "metrics" / "target-rank-0.jsonl",
                [{"step": s, "step_time_s": 1.5, "reward": 0.1} for s in range(1, 21)])
    s = report.summarize(tmp_path)
    assert s["rl_step_speedup"] == pytest.approx(1.5) and s["rl_step_speedup_source"] == "baseline"
    assert s["plain_rollout_tokens_per_s"] is None and s["rl_step_speedup_steps"] == 0


def test_report_files_and_headline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pre, rl = tmp_path / "pre", tmp_path / "rl"
    pretrain_run(pre)
    rl_run(rl)
    path = report.build_report(pre)
    report.print_headline(pre, path)
    out = capsys.readouterr().out
    summary = json.loads((pre / "report" / "summary.json").read_text())
    for key in ("effective_harvest_fraction", "harvested_s_by_rank", "acceptance_length", "acceptance_length_peak"):
        assert key in summary
    text = path.read_text()
    assert "## Per rank" in text and "| 1 | Bubble 0.4 |" in text and "(exports)" in text and "## RL" not in text
    assert (pre / "report" / "timeline.png").stat().st_size > 10_000
    assert "effective_harvest" in out and "rank 0" in out and "rank 1" in out and "harvest_efficiency" in out
    assert "2.5 final, 3.5 peak" in out and "reward" not in out
    assert "exports_rejected         3 below_latest, 1 below_floor" in out
    assert "| exports_rejected_by_cause | below_latest 3, below_floor 1 |" in text
    assert "combine_adjusted         2 work_capped" in out and "| combine_adjusted_by_cause | work_capped 2 |" in text

    path = report.build_report(rl)
    report.print_headline(rl, path)
    out = capsys.readouterr().out
    text = path.read_text()
    assert "## RL" in text and "![rl](rl.png)" in text and (rl / "report" / "rl.png").stat().st_size > 10_000
    rl_section = text.split("## RL", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in rl_section.splitlines() if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [4, 8, 12, 16, 20]     # the steps measured side by side
    assert "reward                   0.120 -> 0.460 (mean of first / last 5 steps)" in out
    assert "rl_step_speedup          1.300x with speculation (median of 5 steps measured side by side" in out


def test_timeline_view_ends_where_every_working_drafter_is_in_view(tmp_path: Path) -> None:
    from spectrain_workloads.report.plots import view_end_ns

    pretrain_run(tmp_path)
    ranks = report.load(tmp_path)
    assert view_end_ns(ranks, 4.0) == T0 + 1200 * MS                 # the run's end: every drafter's work in view
    # A short view: it ends a quarter view after rank 0's last work (900 ms), before the run's end.
    assert view_end_ns(ranks, 0.4) == T0 + 1000 * MS
