"""Forged drafter reports against the real kube-apiserver and operator: each pod writes its report
through the status path (podstatus, with a token of the job's status ServiceAccount bound to it),
as a compromised container of the job could; the operator copies into status.drafter only what
spectrain_api.reports accepts (artifact from the exporting rank's pod, under the export path;
figures in range; a known state), counts the rest and names it in a DrafterReportRefused Event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spectrain_operator import builders, objects, spec
from spectrain_workloads import podstatus
from tests.integration.operator_harness import Env, env_fixture  # noqa: F401  (the env fixture)
from tests.integration.statuspath import as_pod
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def _report(env: Env, pod: dict[str, Any], sa_dir: Path, report: dict[str, Any]) -> None:
    """`pod` writes its drafter report, and it is in the job's status (the write runs on podstatus's
    thread: it must finish while the pod's credentials are in place)."""
    with as_pod(env.kube, pod, sa_dir):
        podstatus.report_drafter(report, flush=True)
        want = json.dumps(report, sort_keys=True)
        wait_for(lambda: json.dumps(json.loads((env.status(pod["metadata"]["labels"][objects.LABEL_JOB]).get(
            "reports", {}).get(pod["metadata"]["uid"]) or {}).get("drafter", "{}")), sort_keys=True) == want,
            20, what=f"{pod['metadata']['name']}'s report in the job's status")


def test_forged_report_fields_are_refused(env: Env, tmp_path: Path) -> None:
    manifest = env.manifest("forge")
    env.create(manifest)
    pods = sorted(env.wait_pods("forge", 2), key=lambda p: p["metadata"]["name"])
    env.run_pods("forge", pods)
    export = builders.export_dir(spec.defaulted(manifest))
    assert [p["metadata"]["name"] for p in pods] == [objects.pod_name(manifest, n) for n in (0, 1)]
    # rank 0's pod is not the exporting one: its artifact, however well formed, and its forged figures
    _report(env, pods[0], tmp_path / "sa0", {"state": "Owned", "harvestedSeconds": 1e12, "harvestEfficiency": 7.0,
                                             "acceptanceLength": 1e9, "artifact": f"{export}/v999"})
    # the exporting (last) rank's pod: a real version is taken, a path elsewhere would not be
    _report(env, pods[1], tmp_path / "sa1", {"state": "Active", "harvestedSeconds": 2.0, "harvestEfficiency": 0.25,
                                             "acceptanceLength": 3.0, "artifact": f"{export}/v3"})
    d = wait_for(lambda: (s := env.status("forge").get("drafter", {})).get("artifact") == f"{export}/v3"
                 and s.get("reportFieldsRefused") == 5 and s, 20, what="status.drafter from the checked reports")
    assert d["state"] == "Active" and d["activeRanks"] == 1
    assert (d["harvestedSeconds"], d["harvestEfficiency"], d["acceptanceLength"]) == (2.0, 0.25, 3.0)
    (event,) = wait_for(lambda: [e for e in env.events("forge") if e["reason"] == "DrafterReportRefused"], 10,
                        what="the DrafterReportRefused Event")
    assert event["type"] == "Warning"
    for field in ("state", "harvestedSeconds", "harvestEfficiency", "acceptanceLength", "artifact"):
        assert f"{pods[0]['metadata']['name']}: {field}=" in event["message"], event["message"]

    _report(env, pods[1], tmp_path / "sa1", {"state": "Active", "artifact": "/etc/v4"})
    d = wait_for(lambda: (s := env.status("forge").get("drafter", {})).get("reportFieldsRefused") == 6 and s, 20,
                 what="the exporting pod's artifact outside the export path refused")
    assert d["artifact"] == f"{export}/v3", "a refused artifact never replaces the last good one"
