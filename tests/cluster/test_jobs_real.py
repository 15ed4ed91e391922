"""SpecTrainJobs run to the end in containers on two real kubelets, installed as a platform team
installs spectrain (tests/cluster/stack.py: the images built from the Dockerfiles, the chart by
helm, a namespace under Pod Security `restricted`, a ReadWriteMany run volume).

examples/demo.yaml, unchanged but for its image: 2 pipeline stages on 2 nodes, each pod's target
with its drafter native sidecar (the ring handed over a Unix socket on a memory emptyDir, the fleet
key Secret read through fsGroup, the status path under the admission policy), the drafters
combining across nodes over pod IPs and exporting to the claim. The job must train a drafter, not
only succeed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from spectrain_api import rundir
from tests.cluster.realcluster import RealCluster
from tests.cluster.stack import Stack, installed

pytestmark = pytest.mark.integration

JOB_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def stack(real_cluster: RealCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with installed(real_cluster, tmp_path_factory.mktemp("stack")) as s:
        yield s


@pytest.fixture(scope="module")
def demo(stack: Stack) -> dict[str, object]:
    m = stack.example("demo.yaml")
    volume = stack.claim(m["spec"]["target"]["checkpoint"]["claimName"])
    stack.apply(m)
    name = m["metadata"]["name"]
    st = stack.wait_phase(name, "Succeeded", JOB_TIMEOUT_S)
    return {"name": name, "status": st, "volume": volume, "pods": stack.pods(name)}


def test_demo_succeeds_and_trains_a_drafter_in_containers(stack: Stack, demo: dict) -> None:
    name, st, volume = demo["name"], demo["status"], Path(demo["volume"])
    why = stack.describe(name)
    assert st["ranks"]["succeeded"] == 2 and st["restarts"] == 0, why
    d = st["drafter"]
    assert d["harvestedSeconds"] > 0, f"the drafters harvested nothing: {d}\n{why}"
    assert stack.condition(name, "DrafterNeverTrained") is None, why
    assert not st.get("drafterFailures"), why
    # both ranks' drafters trained and reported through the job's status
    summaries = {r: json.loads(p.read_text()) for r, p in rundir.drafter_summaries(volume)}
    assert sorted(summaries) == [0, 1], summaries.keys()
    assert all(s["harvestedSeconds"] > 0 and s["samplesTrained"] > 0 for s in summaries.values()), summaries
    # the fleet combined across the nodes (over the pods' IPs, with the job's key): every rank's
    # work is in the export, and the last stage's samples reached the first stage's drafter
    coordinator = next(s for s in summaries.values() if s["fleetRole"] == "coordinator")
    assert sorted(coordinator["exportWorkSecondsByRank"]) == ["0", "1"], coordinator
    assert summaries[0]["samplesFromPeers"] > 0 and not any(s["exchangeRejected"] for s in summaries.values()), summaries
    # the export reached the claim, and the status names it
    assert d["artifact"].startswith("/var/run/spectrain/run/"), d
    exported = volume / d["artifact"].removeprefix("/var/run/spectrain/run/")
    assert (exported / "config.json").is_file() and any(exported.glob("*.safetensors")), sorted(exported.iterdir())


def test_demo_pods_ran_on_both_nodes_as_the_images_user(stack: Stack, demo: dict) -> None:
    pods = demo["pods"]
    assert sorted(p.spec.node_name for p in pods) == sorted(stack.cluster.nodes)
    for p in pods:
        assert p.spec.security_context.run_as_user == 1000 and p.spec.security_context.run_as_non_root
        statuses = {c.name: c for c in (p.status.container_statuses or []) + (p.status.init_container_statuses or [])}
        assert statuses["target"].restart_count == 0
        assert statuses["target"].state.terminated.exit_code == 0


def test_container_logs_show_progress(stack: Stack, demo: dict) -> None:
    pod = demo["pods"][0].metadata.name
    target = stack.logs(pod, "target")
    assert "[spectrain-target rank 0] step 1/" in target and "step 180/180" in target, target[-2000:]
    assert "[spectrain-drafter rank 0]" in stack.logs(pod, "drafter")


def test_kubectl_get_shows_the_figures(stack: Stack, demo: dict) -> None:
    out = stack.kubectl("-n", stack.ns, "get", "stj", demo["name"])
    assert "Succeeded" in out, out
