"""The drafter's Prometheus metrics, on SPECTRAIN_METRICS_PORT + local rank (the pod's drafter
metrics port range; the target's is another one).

The figures are the worker's summary (the dict the status path reads, drafter.metrics and
drafter.replicas): `update(summary)` keeps the newest one and a collector turns it into metric
families at scrape time, so nothing on the worker's loop touches prometheus-client. Conventions:
counters end in `_total`, seconds and bytes are base units, labels are bounded (rank, window kind,
rejection cause, state, direction); never a per-sample or per-window label.

Counters count from this process's start. A drafter resumed from its checkpoint carries its
totals in the summary; exported as they are, a restart would look to `rate()` like a counter reset
followed by the whole total again. `baseline(summary)`, called once the checkpoint is loaded,
takes those totals as zero.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from spectrain_api.names import DRAFTER_STATES

PREFIX = "spectrain_drafter_"

# counter name (without prefix and _total) -> (summary key, help)
_COUNTERS = {
    "usable_seconds": ("usableSeconds", "Idle-window time long enough for a unit of drafter work."),
    "busy_seconds": ("busySeconds", "Time the drafter's tasks ran, inside windows or not."),
    "windows_seen": ("windowsSeen", "Idle windows of the activation kinds the drafter saw."),
    "windows_worked": ("windowsWorked", "Windows the drafter worked in."),
    "windows_too_short": ("windowsTooShort", "Windows of an allowed kind too short for any task."),
    "windows_verify_only": ("windowsVerifyOnly", "Windows that fit a verification chunk but no training step."),
    "samples_trained": ("samplesTrained", "Samples (sequences) the drafter trained on."),
    "combined_work_seconds": ("combinedWorkSeconds", "This rank's window work that a combined version holds, "
                              "i.e. that reaches the export (the numerator of the report's effective harvest)."),
    "optimizer_steps": ("optimizerSteps", "Drafter optimizer steps."),
    "exchange_frames_dropped": ("exchangeFramesDropped", "Exchange frames dropped (bandwidth cap, slow peer, full inbox)."),
    "ring_samples_dropped": ("dataDropped", "Samples the ring overwrote before the drafter read them."),
    "ring_records_corrupt": ("ringRecordsCorrupt", "Complete ring records that did not decode: skipped."),
}
# gauge name -> (summary key, help)
_GAUGES = {
    "acceptance_length": ("acceptanceLength", "Tokens per verification at the last check (k drafted + 1)."),
    "exported_version": ("exportedVersion", "Newest version in the export directory written by this rank."),
    "combined_version": ("combinedVersion", "Newest combined fleet version this rank applied."),
    "loss": ("loss", "Mean training loss over the recent micro-steps."),
}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _series(summary: Mapping[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter's value in `summary`, by (name, extra labels)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for name, (key, _) in _COUNTERS.items():
        if (v := _number(summary.get(key))) is not None:
            out[(name, ())] = v
    for kind, v in (summary.get("harvestedSecondsByKind") or {}).items():
        if (n := _number(v)) is not None:
            out[("harvested_seconds", (("kind", str(kind)),))] = n
    for key, source in (("dataReceived", "ring"), ("samplesFromPeers", "peers")):
        if (v := _number(summary.get(key))) is not None:
            out[("samples_received", (("source", source),))] = v
    for key, direction in (("exchangeBytesSent", "sent"), ("exchangeBytesReceived", "received")):
        if (v := _number(summary.get(key))) is not None:
            out[("exchange_bytes", (("direction", direction),))] = v
    for cause, v in (summary.get("exportsRejectedByCause") or {}).items():
        if (n := _number(v)) is not None:
            out[("exports_rejected", (("cause", str(cause)),))] = n
    for cause, v in (summary.get("exchangeRejectedByCause") or {}).items():
        if (n := _number(v)) is not None:
            out[("exchange_rejected", (("cause", str(cause)),))] = n
    for cause, v in (summary.get("combineAdjustedByCause") or {}).items():
        if (n := _number(v)) is not None:
            out[("combine_adjusted", (("cause", str(cause)),))] = n
    for member, v in (summary.get("exportWorkSecondsByRank") or {}).items():   # the coordinator's
        if (n := _number(v)) is not None:
            out[("export_work_seconds", (("member_rank", str(member)),))] = n
    return out


_HELP = {**{n: h for n, (_, h) in _COUNTERS.items()},
         "harvested_seconds": "Drafter work inside idle windows, by window kind.",
         "samples_received": "Samples that reached the drafter, by source (its ring, its peers).",
         "exchange_bytes": "Bytes of the drafter exchange, by direction.",
         "exports_rejected": "Candidate exports the gate kept from LATEST, by cause (below_latest: under LATEST "
                             "re-measured on the same held-back samples; below_floor: under minAcceptance; "
                             "non_finite; unmeasured; version_reused). Every cause is present from the start.",
         "exchange_rejected": "Items from peers dropped by a check (MAC, shape, vocabulary, finiteness, "
                              "norm, claimed work, version), by cause. Above 0: a broken or hostile peer.",
         "combine_adjusted": "Contributions the coordinator bounded before averaging, by cause (work_capped: "
                             "claimed work above wall time since the rank's last credit; outlier_clipped: update "
                             "far from the round's median; weight_capped: weight above 2x the others' median).",
         "export_work_seconds": "The coordinator's count of each member rank's window work in the versions it "
                                "exported, the last round (combined after the members stopped) included."}
_LABELS = {"harvested_seconds": ["kind"], "samples_received": ["source"], "exchange_bytes": ["direction"],
           "exchange_rejected": ["cause"], "exports_rejected": ["cause"], "combine_adjusted": ["cause"],
           "export_work_seconds": ["member_rank"]}


class DrafterCollector:
    """prometheus-client collector over the newest summary of one drafter rank."""

    def __init__(self, rank: int) -> None:
        self.rank = str(rank)
        self._lock = threading.Lock()
        self._summary: dict[str, Any] = {}
        self._base: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def baseline(self, summary: Mapping[str, Any]) -> None:
        with self._lock:
            self._base = _series(summary)

    def update(self, summary: Mapping[str, Any]) -> None:
        with self._lock:
            self._summary = dict(summary)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            summary, base = self._summary, self._base
        families: dict[str, CounterMetricFamily] = {}
        for (name, extra), value in sorted(_series(summary).items()):
            if name not in families:
                families[name] = CounterMetricFamily(PREFIX + name, _HELP[name], labels=["rank", *_LABELS.get(name, [])])
            # a value below its baseline (a summary from before the checkpoint was loaded) counts from 0
            families[name].add_metric([self.rank, *(v for _, v in extra)], max(0.0, value - base.get((name, extra), 0.0)))
        yield from families.values()
        for name, (key, help_) in _GAUGES.items():
            if (v := _number(summary.get(key))) is not None:
                g = GaugeMetricFamily(PREFIX + name, help_, labels=["rank"])
                g.add_metric([self.rank], v)
                yield g
        overrun = GaugeMetricFamily(PREFIX + "overrun_seconds", "Overrun of worked windows past their end "
                                    "(recent windows), by quantile.", labels=["rank", "quantile"])
        for key, q in (("overrunMsP50", "0.5"), ("overrunMsP99", "0.99"), ("overrunMsMax", "1")):
            if (v := _number(summary.get(key))) is not None:
                overrun.add_metric([self.rank, q], v / 1e3)
        yield overrun
        state = GaugeMetricFamily(PREFIX + "state", "1 for the drafter's current state (status.drafter.state).",
                                  labels=["rank", "state"])
        current = summary.get("state")
        for s in DRAFTER_STATES:
            state.add_metric([self.rank, s], 1.0 if s == current else 0.0)
        yield state


def serve(collector: DrafterCollector, port: int) -> Any:
    """Serve /metrics for `collector` on `port` of the pod's own address (listen.pod_address): a
    metrics_endpoint.Endpoint, whose `final()` keeps the last figures up until scraped."""
    from prometheus_client import CollectorRegistry

    from spectrain_workloads.metrics_endpoint import Endpoint

    reg = CollectorRegistry()
    reg.register(collector)
    return Endpoint(reg, port)


__all__ = ["DrafterCollector", "PREFIX", "serve"]
