"""The `kube` fixture is a real apiserver: objects persist, RBAC is enforced, GC runs."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def _ns(kube, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def test_namespace_and_configmap_roundtrip(kube) -> None:
    ns = _ns(kube, "sanity")
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": ns},
                "data": {"k": "v1"}})
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": ns},
                "data": {"k": "v2"}})
    core = client.CoreV1Api(kube.api_client())
    cm = core.read_namespaced_config_map("cm", ns)
    assert cm.data == {"k": "v2"}
    assert cm.metadata.resource_version


def test_rbac_denies_unbound_user_and_allows_after_binding(kube) -> None:
    ns = _ns(kube, "rbac")
    user = f"alice-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(kube.api_client(kube.kubeconfig_for(user, ["team-a"])))
    with pytest.raises(ApiException) as denied:
        core.list_namespaced_config_map(ns)
    assert denied.value.status == 403
    assert user in denied.value.body

    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": f"cm-reader-{user}"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]})
    kube.bind_cluster_role(f"cm-reader-{user}", group="team-a", namespace=ns)
    # RBAC reads bindings from an informer: the grant becomes visible shortly after the write.
    items = wait_for(lambda: _try_list(core, ns), timeout=10, what="RBAC grant to take effect")
    assert items == "ok"
    with pytest.raises(ApiException) as other_ns:
        core.list_namespaced_config_map("default")
    assert other_ns.value.status == 403


def _try_list(core, ns: str) -> str | None:
    try:
        core.list_namespaced_config_map(ns)
    except ApiException as e:
        if e.status == 403:
            return None
        raise
    return "ok"


def test_service_account_token_authenticates_as_the_service_account(kube) -> None:
    ns = _ns(kube, "sa")
    kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "op", "namespace": ns}})
    auth = client.AuthorizationV1Api(kube.api_client(kube.kubeconfig_for_service_account(ns, "op")))
    review = auth.create_self_subject_access_review({
        "spec": {"resourceAttributes": {"verb": "list", "resource": "pods", "namespace": ns}}})
    assert review.status.allowed is False
    with pytest.raises(ApiException) as denied:
        client.CoreV1Api(auth.api_client).list_namespaced_pod(ns)
    assert f"system:serviceaccount:{ns}:op" in denied.value.body


def test_garbage_collector_deletes_dependents(kube) -> None:
    kube.start_controller_manager()
    ns = _ns(kube, "gc")
    owner = kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner", "namespace": ns}})
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "child", "namespace": ns,
        "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                             "uid": owner["metadata"]["uid"]}]}})
    kube.delete(owner)
    wait_for(lambda: kube.get("v1", "ConfigMap", "child", ns) is None, timeout=20,
             what="GC to delete the dependent ConfigMap")


def test_audit_log_records_denials(kube) -> None:
    ns = _ns(kube, "audit")
    user = f"bob-{uuid.uuid4().hex[:6]}"
    since = kube.audit_offset()
    core = client.CoreV1Api(kube.api_client(kube.kubeconfig_for(user)))
    with pytest.raises(ApiException):
        core.read_namespaced_secret("nope", ns)
    assert kube.denials(since, user) == [f"get secrets {ns}/nope"]


def test_custom_resources_accept_empty_strings(kube) -> None:
    """Guards scripts/build-kube.sh's go-openapi patch: built with Go >= 1.16, an unpatched 1.20
    apiserver rejects "" in every string field of a custom resource (kubernetes#99804)."""
    group = f"g{uuid.uuid4().hex[:6]}.example.org"
    kube.apply({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": f"things.{group}"},
                "spec": {"group": group, "scope": "Namespaced",
                         "names": {"kind": "Thing", "plural": "things"},
                         "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                             "type": "object", "properties": {"spec": {"type": "object", "properties": {
                                 "a": {"type": "string"}, "b": {"type": "string", "default": ""}}}}}}}]}})
    thing = kube.apply({"apiVersion": f"{group}/v1", "kind": "Thing", "metadata": {"name": "t", "namespace": "default"},
                        "spec": {"a": ""}})
    assert thing["spec"] == {"a": "", "b": ""}
