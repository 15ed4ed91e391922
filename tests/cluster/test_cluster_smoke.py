"""Smoke test of the real two-node cluster (scripts/cluster/cluster.sh via the `real_cluster` fixture):
Nodes Ready; a restricted pod (PodSecurity enforce=restricted, UID 1000) with a native sidecar sharing
a memory-backed emptyDir; pod-to-pod across nodes by pod IP; CoreDNS resolving a headless Service
name and kube-proxy serving a ClusterIP Service; the projected ServiceAccount token accepted by the
apiserver through KUBERNETES_SERVICE_HOST. Every wait polls a condition with a deadline.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.cluster.realcluster import RealCluster
from tests.waiting import wait_for

# The first test builds what is missing (cold: the node binaries, the images, helm: tens of minutes).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

TIMEOUT = 90.0


@pytest.fixture(scope="module")
def env(real_cluster: RealCluster) -> Iterator[dict[str, Any]]:
    image = real_cluster.test_image()
    api = real_cluster.api_client()
    core = client.CoreV1Api(api)
    suffix = uuid.uuid4().hex[:6]
    names = {"restricted": f"smoke-restricted-{suffix}", "net": f"smoke-net-{suffix}"}
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=names["restricted"],
        labels={"pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/enforce-version": "latest"})))
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=names["net"])))
    # the ServiceAccount controller must have made `default` before pods can be admitted
    for ns in names.values():
        wait_for(lambda ns=ns: _exists(lambda: core.read_namespaced_service_account("default", ns)),
                 TIMEOUT, 0.2, f"ServiceAccount default in {ns}")
    yield {"core": core, "image": image, "nodes": real_cluster.nodes, "api": api,
           "netpol": real_cluster.netpol, **names}
    for ns in names.values():
        core.delete_namespace(ns)


def _exists(read: Any) -> bool:
    try:
        read()
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


def _restricted_ctx() -> client.V1SecurityContext:
    return client.V1SecurityContext(allow_privilege_escalation=False,
                                    capabilities=client.V1Capabilities(drop=["ALL"]))


def _pod(name: str, image: str, script: str, node: str | None = None, labels: dict | None = None,
         restart: str = "Never") -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels or {}),
        spec=client.V1PodSpec(
            restart_policy=restart, node_name=node, termination_grace_period_seconds=1,
            containers=[client.V1Container(name="main", image=image, image_pull_policy="Never",
                                           command=["python3", "-c", script])]))


def _finished(core: client.CoreV1Api, ns: str, name: str) -> client.V1Pod | None:
    pod = core.read_namespaced_pod(name, ns)
    return pod if pod.status.phase in ("Succeeded", "Failed") else None


def _run_to_completion(core: client.CoreV1Api, ns: str, pod: client.V1Pod) -> str:
    core.create_namespaced_pod(ns, pod)
    done = wait_for(lambda: _finished(core, ns, pod.metadata.name), TIMEOUT, 0.2,
                    f"pod {ns}/{pod.metadata.name} to finish")
    logs = core.read_namespaced_pod_log(pod.metadata.name, ns, container="main")
    assert done.status.phase == "Succeeded", f"{pod.metadata.name} {done.status.phase}:\n{logs}"
    return logs


def _running_ip(core: client.CoreV1Api, ns: str, name: str) -> str | None:
    pod = core.read_namespaced_pod(name, ns)
    ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
    return pod.status.pod_ip if ready else None


def _nodes_ready(core: client.CoreV1Api, names: tuple[str, ...]) -> bool:
    ready = {n.metadata.name for n in core.list_node().items
             if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])}
    return set(names) <= ready


def test_nodes_ready(env: dict[str, Any]) -> None:
    wait_for(lambda: _nodes_ready(env["core"], env["nodes"]), TIMEOUT, 0.2, "both Nodes Ready")


def test_restricted_pod_with_native_sidecar_and_memory_emptydir(env: dict[str, Any]) -> None:
    core, ns, image = env["core"], env["restricted"], env["image"]
    # PodSecurity enforces `restricted` here: a root pod is refused at admission
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(ns, _pod("root", image, "pass"))
    assert refused.value.status == 403 and "restricted" in refused.value.body

    main = r"""
import os, pathlib, sys, time
assert os.getuid() == 1000 and os.getgid() == 1000, (os.getuid(), os.getgid())
mounts = [l.split() for l in open('/proc/mounts')]
shared = [m for m in mounts if m[1] == '/shared']
assert shared and shared[0][2] == 'tmpfs', shared
p = pathlib.Path('/shared/from-sidecar')
deadline = time.monotonic() + 30
while not p.exists():
    assert time.monotonic() < deadline, 'the sidecar never wrote /shared/from-sidecar'
    time.sleep(0.05)
print('uid', os.getuid(), 'sidecar says', p.read_text().strip(), 'mount', shared[0][2])
"""
    sidecar = "import os, pathlib, time; pathlib.Path('/shared/from-sidecar').write_text(f'uid={os.getuid()}'); time.sleep(3600)"
    ctx = _restricted_ctx()
    vol = client.V1VolumeMount(name="shared", mount_path="/shared")
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="restricted"),
        spec=client.V1PodSpec(
            restart_policy="Never", termination_grace_period_seconds=1,
            security_context=client.V1PodSecurityContext(
                run_as_non_root=True, run_as_user=1000, run_as_group=1000, fs_group=1000,
                seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault")),
            volumes=[client.V1Volume(name="shared", empty_dir=client.V1EmptyDirVolumeSource(medium="Memory"))],
            init_containers=[client.V1Container(
                name="sidecar", image=image, image_pull_policy="Never", restart_policy="Always",
                command=["python3", "-c", sidecar], security_context=ctx, volume_mounts=[vol])],
            containers=[client.V1Container(
                name="main", image=image, image_pull_policy="Never",
                command=["python3", "-c", main], security_context=ctx, volume_mounts=[vol])]))
    logs = _run_to_completion(core, ns, pod)
    assert "uid 1000 sidecar says uid=1000 mount tmpfs" in logs, logs
    status = core.read_namespaced_pod("restricted", ns).status
    assert [s.name for s in status.init_container_statuses] == ["sidecar"]


@pytest.fixture(scope="module")
def server(env: dict[str, Any]) -> dict[str, str]:
    """An HTTP server pod on node 2 with a headless and a ClusterIP Service in front of it."""
    core, ns = env["core"], env["net"]
    labels = {"app": "web"}
    core.create_namespaced_pod(ns, _pod(
        "web", env["image"], "import http.server as h; h.ThreadingHTTPServer(('', 8080), h.SimpleHTTPRequestHandler).serve_forever()",
        node=env["nodes"][1], labels=labels, restart="Always"))
    port = [client.V1ServicePort(name="http", port=80, target_port=8080)]
    core.create_namespaced_service(ns, client.V1Service(
        metadata=client.V1ObjectMeta(name="web-headless"),
        spec=client.V1ServiceSpec(cluster_ip="None", selector=labels, ports=port)))
    svc = core.create_namespaced_service(ns, client.V1Service(
        metadata=client.V1ObjectMeta(name="web"), spec=client.V1ServiceSpec(selector=labels, ports=port)))
    ip = wait_for(lambda: _running_ip(core, ns, "web"), TIMEOUT, 0.2, "pod web Ready")
    return {"pod_ip": ip, "cluster_ip": svc.spec.cluster_ip}


def test_pod_to_pod_across_nodes(env: dict[str, Any], server: dict[str, str]) -> None:
    script = f"""
import urllib.request
body = urllib.request.urlopen('http://{server['pod_ip']}:8080/', timeout=10).read()
print('pod-to-pod ok', len(body))
"""
    logs = _run_to_completion(env["core"], env["net"], _pod("p2p", env["image"], script, node=env["nodes"][0]))
    assert "pod-to-pod ok" in logs


def test_headless_dns_and_clusterip_service(env: dict[str, Any], server: dict[str, str]) -> None:
    ns = env["net"]
    script = f"""
import socket, time, urllib.request
# glibc with the pod's search list: short name, then the full name, through CoreDNS
deadline = time.monotonic() + 30
while True:
    try:
        short = socket.gethostbyname('web-headless')
        break
    except OSError as e:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
full = socket.gethostbyname('web-headless.{ns}.svc.cluster.local')
assert short == full == '{server['pod_ip']}', (short, full)
vip = socket.gethostbyname('web')
assert vip == '{server['cluster_ip']}', vip
body = urllib.request.urlopen('http://web/', timeout=10).read()
print('dns ok', short, 'clusterip ok', vip, len(body))
"""
    logs = _run_to_completion(env["core"], ns, _pod("dns", env["image"], script, node=env["nodes"][0]))
    assert "dns ok" in logs and "clusterip ok" in logs


def test_serviceaccount_token_reaches_apiserver(env: dict[str, Any]) -> None:
    ns = env["net"]
    script = """
import json, os, ssl, urllib.request
sa = '/var/run/secrets/kubernetes.io/serviceaccount'
host, port = os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT']
req = urllib.request.Request(
    f'https://{host}:{port}/apis/authentication.k8s.io/v1/selfsubjectreviews', method='POST',
    data=json.dumps({'apiVersion': 'authentication.k8s.io/v1', 'kind': 'SelfSubjectReview'}).encode(),
    headers={'Authorization': 'Bearer ' + open(sa + '/token').read(), 'Content-Type': 'application/json'})
ctx = ssl.create_default_context(cafile=sa + '/ca.crt')
review = json.load(urllib.request.urlopen(req, context=ctx, timeout=10))
print('user', review['status']['userInfo']['username'], 'via', host)
"""
    logs = _run_to_completion(env["core"], ns, _pod("satoken", env["image"], script, node=env["nodes"][1]))
    assert f"user system:serviceaccount:{ns}:default via 10.215.0.1" in logs, logs


def test_networkpolicy_default_deny_blocks_other_namespace(env: dict[str, Any]) -> None:
    if not env["netpol"]:
        pytest.skip("no NetworkPolicy engine in this cluster (kube-router not built)")
    core, image = env["core"], env["image"]
    target = env["net"] + "-np"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=target)))
    try:
        wait_for(lambda: _exists(lambda: core.read_namespaced_service_account("default", target)),
                 TIMEOUT, 0.2, f"ServiceAccount default in {target}")
        core.create_namespaced_pod(target, _pod(
            "web", image, "import http.server as h; h.ThreadingHTTPServer(('', 8080), h.SimpleHTTPRequestHandler).serve_forever()",
            node=env["nodes"][1], labels={"app": "web"}, restart="Always"))
        ip = wait_for(lambda: _running_ip(core, target, "web"), TIMEOUT, 0.2, "pod web Ready")
        reach = f"""
import urllib.request
urllib.request.urlopen('http://{ip}:8080/', timeout=5).read()
print('reachable')
"""
        # without a policy: reachable from another namespace
        assert "reachable" in _run_to_completion(core, env["net"], _pod("np-before", image, reach, node=env["nodes"][0]))
        client.NetworkingV1Api(env["api"]).create_namespaced_network_policy(target, client.V1NetworkPolicy(
            metadata=client.V1ObjectMeta(name="default-deny-ingress"),
            spec=client.V1NetworkPolicySpec(pod_selector=client.V1LabelSelector(), policy_types=["Ingress"])))
        blocked = f"""
import socket, time
deadline = time.monotonic() + 60
while True:  # until kube-router has programmed the policy on the target's node
    try:
        socket.create_connection(('{ip}', 8080), timeout=1).close()
    except OSError as e:
        print('blocked:', e)
        break
    assert time.monotonic() < deadline, 'still reachable 60 s after the default-deny policy'
    time.sleep(0.2)
"""
        assert "blocked" in _run_to_completion(core, env["net"], _pod("np-after", image, blocked, node=env["nodes"][0]))
    finally:
        core.delete_namespace(target)
