"""The drafter's Prometheus endpoint, scraped over HTTP and parsed with prometheus-client's own
parser: names and labels follow the conventions, counters start at the checkpoint's totals as zero."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spectrain_workloads.drafter.prometheus import DrafterCollector, serve
from tests.launch import free_ports

pytestmark = pytest.mark.unit


def _summary(**over: object) -> dict[str, object]:
    s: dict[str, object] = {
        "state": "Active", "usableSeconds": 12.5, "busySeconds": 9.0, "windowsSeen": 40, "windowsWorked": 30,
        "windowsTooShort": 6, "windowsVerifyOnly": 4, "samplesTrained": 512, "optimizerSteps": 64, "combinedWorkSeconds": 4.5,
        "exportsRejected": 3, "exportsRejectedByCause": {"below_latest": 2, "below_floor": 1, "non_finite": 0},
        "exchangeFramesDropped": 3, "dataDropped": 0, "dataReceived": 300,
        "samplesFromPeers": 212, "harvestedSecondsByKind": {"Bubble": 6.0, "Communication": 0.5},
        "exchangeBytesSent": 1_000_000, "exchangeBytesReceived": 2_000_000,
        "exchangeRejectedByCause": {"mac": 7, "tokens_out_of_range": 2},
        "exportWorkSecondsByRank": {"0": 2.5, "3": 4.75},
        "combineAdjustedByCause": {"work_capped": 4, "outlier_clipped": 1, "weight_capped": 0},
        "acceptanceLength": 3.25, "exportedVersion": 5, "combinedVersion": 9, "loss": 1.5,
        "overrunMsP50": 0.4, "overrunMsP99": 2.0, "overrunMsMax": 3.0}
    s.update(over)
    return s


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("spectrain_drafter_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_endpoint_serves_every_figure_with_bounded_labels() -> None:
    c = DrafterCollector(rank=3)
    port = free_ports(1)[0]
    server = serve(c, port)
    try:
        c.update(_summary())
        got = _scrape(port)
    finally:
        server.stop()
    r = ("rank", "3")
    assert got[("spectrain_drafter_harvested_seconds_total", (("kind", "Bubble"), r))] == 6.0
    assert got[("spectrain_drafter_harvested_seconds_total", (("kind", "Communication"), r))] == 0.5
    assert got[("spectrain_drafter_windows_too_short_total", (r,))] == 6
    assert got[("spectrain_drafter_combined_work_seconds_total", (r,))] == 4.5
    assert got[("spectrain_drafter_samples_received_total", (r, ("source", "peers")))] == 212
    assert got[("spectrain_drafter_exchange_bytes_total", (("direction", "received"), r))] == 2_000_000
    assert got[("spectrain_drafter_exchange_rejected_total", (("cause", "mac"), r))] == 7
    assert got[("spectrain_drafter_exports_rejected_total", (("cause", "below_latest"), r))] == 2
    assert got[("spectrain_drafter_exports_rejected_total", (("cause", "below_floor"), r))] == 1
    assert got[("spectrain_drafter_exports_rejected_total", (("cause", "non_finite"), r))] == 0
    assert got[("spectrain_drafter_export_work_seconds_total", (("member_rank", "0"), r))] == 2.5
    assert got[("spectrain_drafter_export_work_seconds_total", (("member_rank", "3"), r))] == 4.75
    assert got[("spectrain_drafter_combine_adjusted_total", (("cause", "work_capped"), r))] == 4
    assert got[("spectrain_drafter_combine_adjusted_total", (("cause", "weight_capped"), r))] == 0
    assert got[("spectrain_drafter_acceptance_length", (r,))] == 3.25
    assert got[("spectrain_drafter_exported_version", (r,))] == 5
    assert got[("spectrain_drafter_overrun_seconds", (("quantile", "0.99"), r))] == pytest.approx(0.002)
    states = {dict(k[1])["state"]: v for k, v in got.items() if k[0] == "spectrain_drafter_state"}
    assert states == {"Disabled": 0, "Waiting": 0, "Active": 1, "Degraded": 0}
    label_names = {name for _, labels in got for name, _ in labels}
    assert label_names <= {"rank", "kind", "source", "direction", "cause", "quantile", "state", "member_rank"}


def test_counters_count_from_the_process_start_not_from_the_checkpoint() -> None:
    c = DrafterCollector(rank=0)
    resumed = _summary(samplesTrained=500, harvestedSecondsByKind={"Bubble": 100.0},
                       exchangeRejectedByCause={})
    c.baseline(resumed)            # the totals the checkpoint brought back
    c.update(_summary(samplesTrained=520, harvestedSecondsByKind={"Bubble": 101.5},
                      exchangeRejectedByCause={"mac": 2}))
    got = {(m.name, s.labels.get("kind") or s.labels.get("cause")): s.value
           for m in c.collect() for s in m.samples}
    assert got[("spectrain_drafter_samples_trained", None)] == 20
    assert got[("spectrain_drafter_harvested_seconds", "Bubble")] == pytest.approx(1.5)
    assert got[("spectrain_drafter_exchange_rejected", "mac")] == 2


def test_an_empty_or_malformed_summary_serves_what_it_can() -> None:
    c = DrafterCollector(rank=1)
    assert {m.name for m in c.collect()} == {"spectrain_drafter_overrun_seconds", "spectrain_drafter_state"}
    c.update({"samplesTrained": "many", "loss": None, "exportedVersion": True, "state": "Waiting"})
    names = {m.name for m in c.collect() if m.samples}
    assert names == {"spectrain_drafter_state"}
