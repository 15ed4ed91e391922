"""The workloads' status path (spectrain_workloads.podstatus and the drafter's control) run in the test
process as one pod of a job would run it, against the real kube-apiserver: the pod's environment (job,
pod name, namespace, UID), the API server's address, and a token of the job's status ServiceAccount
bound to that pod, with the cluster CA, where the kubelet would mount them. There is no kubelet (kwok
runs no containers), so this is the one piece the tests put in place by hand; everything it talks to
is real: the Role the operator created, the apiserver's RBAC and its status subresource.
"""

from __future__ import annotations

import shutil
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from spectrain_api.names import ENV_JOB_NAME, ENV_POD_NAME, ENV_POD_NAMESPACE, ENV_POD_UID
from spectrain_operator import objects
from spectrain_workloads import podstatus
from tests.integration.kubeapi import KubeAPI


@contextmanager
def as_pod(kube: KubeAPI, pod: dict[str, Any], sa_dir: Path) -> Iterator[None]:
    """podstatus in this process speaks for `pod` (a pod object of a SpecTrainJob) until the block ends."""
    meta = pod["metadata"]
    job = meta["labels"][objects.LABEL_JOB]
    sa_dir.mkdir(parents=True, exist_ok=True)
    account = objects.status_account_name({"metadata": {"name": job}})
    (sa_dir / "token").write_text(kube.service_account_token(meta["namespace"], account, pod=pod))
    shutil.copyfile(kube.pki / "ca.crt", sa_dir / "ca.crt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(podstatus, "SA_DIR", sa_dir)
        mp.setattr(podstatus, "_warned", False)
        podstatus._last_patch.clear()          # the module's throttle state: this pod starts afresh
        podstatus._flushed.clear()
        env = {ENV_JOB_NAME: job, ENV_POD_NAME: meta["name"], ENV_POD_NAMESPACE: meta["namespace"],
               ENV_POD_UID: meta["uid"], "KUBERNETES_SERVICE_HOST": "127.0.0.1",
               "KUBERNETES_SERVICE_PORT": str(kube.port)}
        for key, value in env.items():
            mp.setenv(key, value)
        yield
        podstatus._last_patch.clear()


def request_status(method: str, url_tail: str, body: dict[str, Any] | None = None) -> int:
    """The HTTP status of one request made with the current pod's token (`as_pod`), `url_tail` relative
    to the API server (e.g. /api/v1/namespaces/ns/pods/p)."""
    where = podstatus._in_cluster()
    assert where is not None, "not inside as_pod"
    try:
        podstatus._request(where, method, where.server + url_tail, body)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200
