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
from pathlib import Path

import pytest
from kubernetes import client

from spectrain_api import rundir
from spectrain_api.names import KIND
from spectrain_operator.builders import MASTER_PORT, TARGET_METRICS_PORT
from spectrain_operator.objects import fleet_identity_name
from tests.cluster.stack import GROUP, LEASE_DURATION_S, PLURAL, VERSION, Stack
from tests.waiting import wait_for

# The first test builds what is missing (cold: the node binaries, the images, helm: tens of minutes).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

JOB_TIMEOUT_S = 900.0


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


def test_demo_pods_ran_as_the_images_user_and_were_asked_to_spread(stack: Stack, demo: dict) -> None:
    pods = demo["pods"]
    # One pod per node is asked for (a preferred anti-affinity), not forced: the scheduler may
    # still put both on one node, where nothing like a GPU request keeps them apart.
    for p in pods:
        term = p.spec.affinity.pod_anti_affinity.preferred_during_scheduling_ignored_during_execution[0]
        assert term.pod_affinity_term.topology_key == "kubernetes.io/hostname"
    print("demo pods on", sorted(p.spec.node_name for p in pods))
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


def test_leader_failover_hands_over_within_the_lease_and_reconciles_a_new_job(stack: Stack) -> None:
    """The chart's 2 operator replicas: SIGKILL the Lease holder's container (no graceful release);
    the other replica holds the Lease within leaseDurationSeconds (+ its retry period) and
    reconciles a job created after the kill. That job's drafters run with `activation.policy: Off`
    (the pod spec without a fleet identity): each sidecar idles, stops when its target is done,
    and the job is Succeeded once the pods have finished."""
    assert len(stack.operator_pods()) == 2
    _, failover_s = stack.kill_leader()
    stack.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                 "metadata": {"name": "after-failover", "namespace": stack.ns},
                 "spec": {"target": {"image": stack.workloads_image, "nodes": 2, "command": ["sh", "-c", "exit 0"],
                                     "parallelism": {"data": 2}},
                          "drafter": {"activation": {"policy": "Off"}}, "gpuSharing": {"mode": "None"}}})
    assert failover_s <= LEASE_DURATION_S + 10, failover_s
    stack.wait_phase("after-failover", "Succeeded", 300)
    print(f"leader_failover_s {failover_s:.1f}")
    identities = {fleet_identity_name({"metadata": {"name": "after-failover"}}, n, 0) for n in range(2)}
    problems = []
    for p in stack.pods("after-failover"):
        drafters = [c for c in p.status.init_container_statuses or [] if c.name == "drafter"]
        secrets = {v.secret.secret_name for v in p.spec.volumes if v.secret is not None}
        if (p.status.phase != "Succeeded" or len(drafters) != 1 or drafters[0].restart_count != 0
                or drafters[0].state.terminated is None or not secrets or secrets & identities):
            problems.append((p.metadata.name, p.status.phase, drafters, sorted(secrets)))
    assert not problems, (problems, stack.describe("after-failover"))


RENDEZVOUS = MASTER_PORT            # the target's c10d store
METRICS = TARGET_METRICS_PORT      # local rank 0's
# One pod per source namespace probes its targets ([[ip, port, expected], ...]) until each expected
# "connected" has connected, then once more every target, or until the deadline: a NetworkPolicy
# reaches a new pod's IP a moment after the pod starts (kube-router syncs on the pod's event), so
# a refusal counts only once this very pod has been let through where it should be.
PROBE = ("import json, socket, sys, time\n"
         "want, deadline, got = json.loads(sys.argv[1]), time.monotonic() + float(sys.argv[2]), {}\n"
         "def attempt(ip, port):\n"
         "    try:\n"
         "        socket.create_connection((ip, port), timeout=2).close()\n"
         "        return True\n"
         "    except OSError:\n"
         "        return False\n"
         "while True:\n"
         "    synced = all(got.get(f'{ip}:{port}') for ip, port, e in want if e == 'connected')\n"
         "    for ip, port, _ in want:\n"
         "        got[f'{ip}:{port}'] = got.get(f'{ip}:{port}') or attempt(ip, port)\n"
         "    if synced or time.monotonic() > deadline:\n"
         "        break\n"
         "print(json.dumps(got))\n")
PROBE_PATIENCE_S = 90


def test_the_jobs_network_policy_keeps_other_namespaces_out(stack: Stack) -> None:
    """The job's NetworkPolicy, enforced (kube-router): its pods reach each other's rendezvous port
    across nodes; a pod of another namespace cannot open it, nor the metrics port unless its
    namespace is one of spec.networkPolicy.metricsFrom; it can open the same port of a job whose
    policy is off (so the refusals are the policy's)."""
    assert stack.cluster.netpol, "kube-router is not running: NetworkPolicy would not be enforced"
    serve = ["python3", "-c", "import http.server as h, threading, sys\n"
             "for p in sys.argv[1:]:\n"
             "    s = h.ThreadingHTTPServer(('', int(p)), h.BaseHTTPRequestHandler)\n"
             "    threading.Thread(target=s.serve_forever).start()\n", str(RENDEZVOUS), str(METRICS)]
    allowed = {"spectrain-test/scrapes": "yes"}
    ips = {}
    for name, enabled in (("np", True), ("np-off", False)):
        stack.apply({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name, "namespace": stack.ns},
                     "spec": {"target": {"image": stack.workloads_image, "nodes": 2, "command": serve,
                                         "parallelism": {"data": 2}},
                              "drafter": {"enabled": False}, "gpuSharing": {"mode": "None"},
                              "networkPolicy": {"enabled": enabled, "metricsFrom": {"matchLabels": allowed}}}})
    for name in ("np", "np-off"):
        stack.wait_phase(name, "Running", 300)
        pods = {p.metadata.name: p for p in stack.pods(name)}
        ips[name] = pods[f"{name}-0"].status.pod_ip
        assert pods[f"{name}-0"].spec.node_name != pods[f"{name}-1"].spec.node_name
    inside = stack.kubectl("-n", stack.ns, "exec", "np-1", "-c", "target", "--", "python3", "-c", PROBE,
                           json.dumps([[ips["np"], RENDEZVOUS, "connected"]]), str(PROBE_PATIENCE_S),
                           timeout=PROBE_PATIENCE_S + 30)
    assert json.loads(inside.strip().splitlines()[-1]) == {f"{ips['np']}:{RENDEZVOUS}": True}, inside
    outsider, monitoring = f"{stack.ns}-out", f"{stack.ns}-mon"
    for ns, labels in ((outsider, {}), (monitoring, allowed)):
        stack.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, labels=labels)))
    try:
        probes = {("out", "np", RENDEZVOUS): "refused", ("out", "np", METRICS): "refused",
                  ("mon", "np", RENDEZVOUS): "refused", ("mon", "np", METRICS): "connected",
                  ("out", "np-off", RENDEZVOUS): "connected"}
        seen = _probe_all(stack, {k: ({"out": outsider, "mon": monitoring}[k[0]], ips[k[1]], k[2], want)
                                  for k, want in probes.items()})
        assert seen == probes, seen
    finally:
        for ns in (outsider, monitoring):
            stack.core.delete_namespace(ns)
        for name in ips:
            stack.custom.delete_namespaced_custom_object(GROUP, VERSION, stack.ns, PLURAL, name)


def _probe_all(stack: Stack, probes: dict[tuple, tuple[str, str, int, str]]) -> dict[tuple, str]:
    """probes: key -> (namespace, ip, port, expected). One PROBE pod per namespace, all at once:
    'connected' or 'refused' per key."""
    by_ns: dict[str, list[tuple]] = {}
    for key, (ns, *_) in probes.items():
        by_ns.setdefault(ns, []).append(key)
    for ns in by_ns:
        wait_for(lambda ns=ns: _has_default_sa(stack, ns), 60, 0.2, f"ServiceAccount default in {ns}")
        want = json.dumps([list(probes[k][1:]) for k in by_ns[ns]])
        stack.core.create_namespaced_pod(ns, client.V1Pod(
            metadata=client.V1ObjectMeta(name="probe"),
            spec=client.V1PodSpec(restart_policy="Never", containers=[client.V1Container(
                name="probe", image=stack.workloads_image, image_pull_policy="IfNotPresent",
                command=["python3", "-c", PROBE, want, str(PROBE_PATIENCE_S)])])))
    seen = {}
    for ns, keys in by_ns.items():
        wait_for(lambda ns=ns: stack.core.read_namespaced_pod("probe", ns).status.phase in ("Succeeded", "Failed"),
                 PROBE_PATIENCE_S + 60, 0.5, f"{ns}/probe finished")
        log = stack.core.read_namespaced_pod_log("probe", ns)
        got = json.loads(log.strip().splitlines()[-1])
        for k in keys:
            seen[k] = "connected" if got[f"{probes[k][1]}:{probes[k][2]}"] else "refused"
    return seen


def _has_default_sa(stack: Stack, ns: str) -> bool:
    try:
        stack.core.read_namespaced_service_account("default", ns)
        return True
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return False
        raise
