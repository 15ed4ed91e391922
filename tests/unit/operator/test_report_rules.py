"""A pod's drafter report is a claim any container of the job can write: spectrain_api.reports keeps
a field only in its type and range, `artifact` only from the exporting rank's pod and only naming a
version directory of the job's export path; the operator copies nothing else into status.drafter,
counts what it refused and says so in an Event."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from spectrain_api.names import REPORT_DRAFTER, STATUS_REPORTS
from spectrain_api.reports import HARVEST_CLOCK_SLACK_S, artifact_ok, checked_drafter_report, export_rank
from spectrain_operator import builders, objects
from spectrain_operator import status as st
from tests.unit.operator.test_status import NOW, created_status, job, reports, running

EXPORT = "/var/run/spectrain/run/drafter"


def check(report: dict[str, Any], exporting: bool = True, max_harvest_s: float = 1e4) -> tuple[dict, list[str]]:
    ok, bad = checked_drafter_report(report, exporting=exporting, export_dir=EXPORT, max_harvest_s=max_harvest_s)
    return ok, [r.field for r in bad]


def test_an_honest_report_passes_whole() -> None:
    r = {"state": "Active", "reason": "", "harvestedSeconds": 12.5, "harvestEfficiency": 0.75,
         "acceptanceLength": 3.2, "artifact": f"{EXPORT}/v12", "loss": 1.0}
    ok, bad = check(r)
    assert bad == [] and ok == {k: v for k, v in r.items() if k != "loss"}
    assert check({"state": "Waiting", "acceptanceLength": None, "artifact": ""}) == ({"state": "Waiting"}, [])


@pytest.mark.parametrize("field,value", [
    ("state", "Owned"), ("state", 3),
    ("harvestedSeconds", -1.0), ("harvestedSeconds", 1e4 + 1), ("harvestedSeconds", float("nan")),
    ("harvestedSeconds", "12"), ("harvestedSeconds", True),
    ("harvestEfficiency", 1.5), ("harvestEfficiency", -0.1), ("harvestEfficiency", float("inf")),
    ("acceptanceLength", 0.5), ("acceptanceLength", 1e9), ("acceptanceLength", float("-inf")),
    ("artifact", "/elsewhere/v3"), ("artifact", f"{EXPORT}/v3/../../../etc"), ("artifact", f"{EXPORT}/latest"),
    ("artifact", f"{EXPORT}/v"), ("artifact", f"{EXPORT}v3"), ("artifact", f"{EXPORT}/v1234567890"), ("artifact", 7),
])
def test_a_forged_field_is_refused_and_never_kept(field: str, value: Any) -> None:
    ok, bad = check({"state": "Active", field: value} if field != "state" else {field: value})
    assert bad == [field] and field not in ok


def test_artifact_only_from_the_exporting_rank() -> None:
    ok, bad = check({"artifact": f"{EXPORT}/v3"}, exporting=False)
    assert bad == ["artifact"] and "artifact" not in ok
    assert export_rank(8) == 7
    assert artifact_ok(f"{EXPORT}/v3", EXPORT + "/") and not artifact_ok(f"{EXPORT}/v3/", EXPORT)


def _decide(j: dict[str, Any], by_node: dict[int, dict[str, Any]]) -> Any:
    pods = running(j)
    j["status"][STATUS_REPORTS] = reports(pods, **{f"n{n}": {REPORT_DRAFTER: json.dumps(r)} for n, r in by_node.items()})
    return st.decide(j, pods, NOW)


def test_the_operator_takes_the_artifact_from_the_exporting_pod_only() -> None:
    j = job(created_status())
    good = f"{builders.export_dir(j)}/v4"
    plan = _decide(j, {0: {"state": "Active", "artifact": f"{builders.export_dir(j)}/v99"}, 1: {"artifact": good}})
    d = plan.status["drafter"]
    assert d["artifact"] == good and d["reportFieldsRefused"] == 1
    (ev,) = [e for e in plan.events if e.reason == "DrafterReportRefused"]
    assert ev.type == "Warning" and f"pod {objects.pod_name(j, 0)}: artifact=" in ev.message
    assert "only the exporting rank's pod exports" in ev.message


def test_forged_figures_keep_the_previous_ones_and_the_event_is_not_repeated() -> None:
    prev = {"state": "Active", "activeRanks": 1, "harvestedSeconds": 5.0, "harvestEfficiency": 0.5,
            "acceptanceLength": 2.5, "artifact": "", "reportFieldsRefused": 0}
    j = job(created_status(drafter=prev))
    j["metadata"]["creationTimestamp"] = st.fmt_time(NOW - timedelta(minutes=10))
    cap = j["spec"]["target"]["procsPerNode"] * (600 + HARVEST_CLOCK_SLACK_S)
    forged = {"state": "Pwned", "harvestedSeconds": cap + 1, "harvestEfficiency": 7.0, "acceptanceLength": 1e9,
              "artifact": "/tmp/evil/v1"}
    plan = _decide(j, {1: forged})
    d = plan.status["drafter"]
    assert (d["harvestedSeconds"], d["harvestEfficiency"], d["acceptanceLength"]) == (5.0, 0.5, 2.5)
    assert d["state"] == "Waiting" and "artifact" not in d and d["reportFieldsRefused"] == 5
    assert [e.reason for e in plan.events].count("DrafterReportRefused") == 1
    j2 = job(created_status(drafter=d))        # the next pass, same reports: counted, not announced again
    j2["metadata"]["creationTimestamp"] = j["metadata"]["creationTimestamp"]
    plan2 = _decide(j2, {1: forged})
    assert plan2.status["drafter"]["reportFieldsRefused"] == 5
    assert "DrafterReportRefused" not in [e.reason for e in plan2.events]
    assert _decide(job(created_status()), {1: {"harvestedSeconds": cap}}).status["drafter"]["reportFieldsRefused"] == 1
