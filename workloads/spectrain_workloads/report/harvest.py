"""Idle time, harvested time and the effective harvest, per rank and for the run.

Definitions (the drafter's own, drafter/metrics.py, recomputed from the logs so a report of a run
whose drafter died still has them):
- idle seconds (by kind): the target's closed windows (metrics/windows-rank-<r>.jsonl);
- harvested seconds (by kind): drafter busy time inside those windows (the work records'
  busy_in_window_ns; for a window whose end the drafter never saw, the work interval clipped to
  the window's end as the target logged it);
- effective seconds: harvested seconds whose result reaches the exported model. A drafter that
  reports `combinedWorkSeconds` in its summary (the fleet: its window work contained in a combined
  model version) is taken at its word. Otherwise only the exporting drafter's (summary `artifact`
  set) work counts, and only work that ended before the export it is now at was written: the other
  ranks' drafters train copies that no export ever contains, however busy they are;
- unusable seconds: idle seconds in windows shorter than the drafter's unit of work + margin, of
  kinds it does not use, or before it was ready (idle - the drafter's `usableSeconds`); windows too short to train in but
  long enough for an acceptance measurement on fresh samples are counted (`windows_verify_only`);
- effective harvest fraction: effective seconds of all ranks / idle seconds of all ranks. It is the
  figure that says how much of the idle GPU time became drafter quality;
- exchange MB/s: bytes the drafter sent + received with its peers (`exchangeBytesSent`,
  `exchangeBytesReceived` in its summary) over the rank's wall time in the logs. Monotonic clocks
  are per machine, so each rank's wall time comes from its own logs only.
"""

from __future__ import annotations

import statistics
from typing import Any

from spectrain_workloads.report.data import RankData
from spectrain_workloads.report.data import is_number as _num

KINDS = ("Bubble", "Communication", "Imbalance", "RolloutTail")
NO_WINDOW = -1     # drafter/metrics.py: work under policy Always outside any window (not idle time)


def idle_by_kind(rd: RankData) -> dict[str, float]:
    idle = {k: 0.0 for k in KINDS}
    for w in rd.windows:
        idle[w["kind"]] = idle.get(w["kind"], 0.0) + w.get("actual_ns", 0) / 1e9
    return idle


def work_in_windows(rd: RankData) -> list[tuple[dict[str, Any], float]]:
    """(work record, harvested seconds) for every drafter work record inside a window."""
    ends = {w["window_id"]: w["start_ns"] + w.get("actual_ns", 0) for w in rd.windows}
    out = []
    for ev in rd.events("work"):
        wid = ev.get("window_id")
        if wid == NO_WINDOW:
            continue
        if _num(ev.get("busy_in_window_ns")) and ev.get("window_end_ns") is not None:
            seconds = ev["busy_in_window_ns"] / 1e9
        else:
            end = ends.get(wid)
            busy_end = ev["end_ns"] if end is None else min(ev["end_ns"], end)
            seconds = max(0, busy_end - ev["start_ns"]) / 1e9
        out.append((ev, seconds))
    return out


def export_cutoff_ns(rd: RankData) -> int | None:
    """When the export the drafter is now at (its summary's artifact) was written; None: unknown."""
    art = rd.summary.get("artifact")
    times = [e["t_ns"] for e in rd.events("checkpoint") if art and e.get("artifact") == art and _num(e.get("t_ns"))]
    return min(times) if times else None


def in_window_share(rd: RankData, inside_s: float) -> float:
    """The part of the drafter's busy time (`busySeconds`) that was inside windows. The drafter
    counts its combined work by whole tasks, a task that ran past its window's end included; only
    the part inside windows was idle time."""
    busy = rd.summary.get("busySeconds")
    return min(1.0, inside_s / float(busy)) if _num(busy) and float(busy) > 0 else 1.0


def effective_seconds(rd: RankData, work: list[tuple[dict[str, Any], float]]) -> float:
    combined = rd.summary.get("combinedWorkSeconds")
    if _num(combined):
        return float(combined) * in_window_share(rd, sum(s for _, s in work))
    if not rd.summary.get("artifact"):
        return 0.0
    cutoff = export_cutoff_ns(rd)
    return sum(s for ev, s in work if cutoff is None or ev.get("end_ns", 0) <= cutoff)


def wall_seconds(rd: RankData) -> float:
    """The rank's span in its logs: the drafter's events, else the target's step records."""
    ts = [e["t_ns"] for e in rd.drafter if _num(e.get("t_ns"))]
    if len(ts) < 2:
        ts = [s["time_ns"] for s in rd.steps if _num(s.get("time_ns"))]
    return (max(ts) - min(ts)) / 1e9 if len(ts) >= 2 else 0.0


def exchange_mb_per_s(rd: RankData) -> float | None:
    """None when the drafter reports no exchange counters (no fleet)."""
    parts = [rd.summary.get(k) for k in ("exchangeBytesSent", "exchangeBytesReceived")]
    if not any(_num(p) for p in parts):
        return None
    wall = wall_seconds(rd)
    total = sum(float(p) for p in parts if _num(p))
    return total / 1e6 / wall if wall > 0 else 0.0


def rank_figures(rd: RankData) -> dict[str, Any]:
    work = work_in_windows(rd)
    idle = idle_by_kind(rd)
    harvested = {k: 0.0 for k in KINDS}
    for ev, s in work:
        harvested[ev.get("kind", "Bubble")] = harvested.get(ev.get("kind", "Bubble"), 0.0) + s
    usable = rd.summary.get("usableSeconds")
    return {
        "idle_s_by_kind": idle, "harvested_s_by_kind": harvested,
        "idle_s": sum(idle.values()), "harvested_s": sum(harvested.values()),
        # idle seconds no drafter task could use: windows shorter than its unit of work + margin, of
        # kinds not in activation.kinds, or before it was ready (its own usableSeconds is the rest)
        "unusable_s": max(0.0, sum(idle.values()) - float(usable)) if _num(usable) else None,
        # windows that fit only an acceptance measurement on fresh samples, and were used for one
        "windows_verify_only": rd.summary.get("windowsVerifyOnly"),
        "effective_s": effective_seconds(rd, work),
        "exports": bool(rd.summary.get("artifact")),
        "exchange_mb_per_s": exchange_mb_per_s(rd),
        "drafter": (f"{rd.summary.get('state', '?')}" + (f" ({rd.summary['reason']})" if rd.summary.get("reason") else "")
                    if rd.has_drafter else "none"),
    }


def overruns_ms(rd: RankData) -> list[float]:
    ends = {w["window_id"]: w["start_ns"] + w.get("actual_ns", 0) for w in rd.windows}
    return [max(0, ev["end_ns"] - ends[ev["window_id"]]) / 1e6 for ev in rd.events("work")
            if ev.get("window_id") in ends]


def exported_by_rank(ranks: dict[int, RankData]) -> dict[int, float]:
    """The coordinator's own count of each rank's work in the versions it exported (its summary's
    `exportWorkSecondsByRank`): it includes the last round, combined after the members stopped."""
    for rd in ranks.values():
        by = rd.summary.get("exportWorkSecondsByRank")
        if isinstance(by, dict) and by:
            return {int(r): float(s) for r, s in by.items() if str(r).isdigit() and _num(s)}
    return {}


def harvest(ranks: dict[int, RankData]) -> dict[str, Any]:
    per = {r: rank_figures(rd) for r, rd in ranks.items()}
    for r, s in exported_by_rank(ranks).items():
        if r in per:
            p = per[r]
            p["effective_s"] = max(p["effective_s"], s * in_window_share(ranks[r], p["harvested_s"]))
    idle = {k: sum(p["idle_s_by_kind"].get(k, 0.0) for p in per.values()) for k in KINDS}
    harvested = {k: sum(p["harvested_s_by_kind"].get(k, 0.0) for p in per.values()) for k in KINDS}
    total_idle, total_h = sum(idle.values()), sum(harvested.values())
    effective = sum(p["effective_s"] for p in per.values())
    effs = [rd.summary["harvestEfficiency"] for rd in ranks.values() if _num(rd.summary.get("harvestEfficiency"))]
    overruns = sorted(o for rd in ranks.values() for o in overruns_ms(rd))
    return {
        "idle_s_by_kind": idle, "harvested_s_by_kind": harvested,
        "idle_s": total_idle, "harvested_s": total_h,
        "harvested_fraction_of_idle": total_h / total_idle if total_idle else None,
        "effective_harvest_s": effective,
        "effective_harvest_fraction": effective / total_idle if total_idle else None,
        "harvest_efficiency": statistics.median(effs) if effs else None,   # the drafter's own: busy / usable idle
        "overrun_ms_p99": overruns[int(0.99 * (len(overruns) - 1))] if overruns else None,
        # JSON object keys are strings; the rank is one
        "harvested_s_by_rank": {str(r): p["harvested_s"] for r, p in per.items()},
        "effective_s_by_rank": {str(r): p["effective_s"] for r, p in per.items()},
        "per_rank": {str(r): p for r, p in per.items()},
    }


def acceptance(ranks: dict[int, RankData]) -> dict[str, float | None]:
    """The drafter's acceptance length: final (the newest measurement of an exporting drafter: what
    the exported model does) and peak (the best any drafter measured during the run)."""
    events = [(e.get("t_ns", 0), r, a) for r, rd in ranks.items() for e in rd.events("acceptance")
              if _num(a := e.get("acceptance_length", e.get("acceptance")))]
    summaries = {r: rd.summary["acceptanceLength"] for r, rd in ranks.items() if _num(rd.summary.get("acceptanceLength"))}
    exporters = {r for r, rd in ranks.items() if rd.summary.get("artifact")}
    pool = [x for x in events if x[1] in exporters] or events
    if pool:
        final: float | None = float(max(pool)[2])
    else:
        accs = [a for r, a in summaries.items() if r in exporters] or list(summaries.values())
        final = float(max(accs)) if accs else None
    every = [float(a) for *_, a in events] + [float(a) for a in summaries.values()]
    return {"acceptance_length": final, "acceptance_length_peak": max(every) if every else None}


__all__ = ["KINDS", "acceptance", "effective_seconds", "exchange_mb_per_s", "harvest", "idle_by_kind",
           "rank_figures", "wall_seconds", "work_in_windows"]
