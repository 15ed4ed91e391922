"""spectrain_operator.pods: the pod accessors, defensive against whatever a pod's status holds."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from spectrain_api.names import MAX_REPORT_CHARS
from spectrain_operator import builders, pods

pytestmark = pytest.mark.unit

UTC = timezone.utc


@pytest.mark.parametrize("value,expected", [
    ("2026-01-01T12:00:00Z", datetime(2026, 1, 1, 12, tzinfo=UTC)),
    ("2026-01-01T12:00:00", datetime(2026, 1, 1, 12, tzinfo=UTC)),            # naive: taken as UTC
    ("2026-01-01T14:00:00+02:00", datetime(2026, 1, 1, 12, tzinfo=UTC)),
    (datetime(2026, 1, 1, 12), datetime(2026, 1, 1, 12, tzinfo=UTC)),
    ("", None), ("yesterday", None), (None, None), (1767268800, None), ({"t": 1}, None),
])
def test_parse_time_is_aware_and_utc(value: Any, expected: datetime | None) -> None:
    t = pods.parse_time(value)
    assert t == expected
    assert t is None or t.tzinfo is not None


def test_fmt_time_round_trips() -> None:
    t = datetime(2026, 1, 1, 14, 0, 5, tzinfo=timezone(timedelta(hours=2)))
    assert pods.fmt_time(t) == "2026-01-01T12:00:05Z"
    assert pods.parse_time(pods.fmt_time(t)) == t


def _pod(status: Any = None, spec: Any = None, labels: Any = None, annotations: Any = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec or {}, "status": status}


TERMINATED = {"terminated": {"exitCode": 87, "finishedAt": "2026-01-01T12:00:00Z"}}


@pytest.mark.parametrize("accessor,pod,expected", [
    (pods.pod_node, _pod(labels={builders.LABEL_NODE: "3"}), 3),
    (pods.pod_node, _pod(labels={builders.LABEL_NODE: "x"}), None),
    (pods.pod_node, _pod(), None),
    (pods.pod_generation, _pod(labels={builders.LABEL_GENERATION: "2"}), 2),
    (pods.pod_generation, _pod(labels=None), None),
    (pods.pod_running, _pod({"phase": "Running"}), True),
    (pods.pod_running, _pod(None), False),
    (pods.is_finished, _pod({"phase": "Failed"}), True),
    (pods.is_finished, _pod({"phase": "Running"}), False),
    (pods.pod_ready, _pod({"conditions": [{"type": "Ready", "status": "True"}]}), True),
    (pods.pod_ready, _pod({"conditions": [{"type": "Ready", "status": "False"}, "junk"]}), False),
    (pods.pod_scheduled, _pod({}, spec={"nodeName": "n"}), True),
    (pods.pod_scheduled, _pod({"conditions": [{"type": "PodScheduled", "status": "True"}]}), True),
    (pods.pod_scheduled, _pod({}), False),
    (pods.still_running, _pod({"phase": "Running"}, spec={"nodeName": "n"}), True),
    (pods.still_running, _pod({"phase": "Succeeded"}, spec={"nodeName": "n"}), False),
    (pods.still_running, _pod({"phase": "Pending"}), False),
    (pods.target_exit_code, _pod({"containerStatuses": [{"name": "target", "state": {"terminated": {"exitCode": 3}}}]}), 3),
    (pods.target_exit_code, _pod({"containerStatuses": [{"name": "target", "state": {"terminated": {}}}]}), -1),
    (pods.target_exit_code, _pod({"containerStatuses": [{"name": "target", "state": {"running": {}}}]}), None),
    (pods.target_exit_code, _pod({"containerStatuses": "junk"}), None),
    (pods.pod_succeeded, _pod({"phase": "Succeeded"}), True),
    (pods.pod_succeeded, _pod({"containerStatuses": [{"name": "target", "state": {"terminated": {"exitCode": 0}}}]}),
     True),
    (pods.is_deleted, {"metadata": {"name": "p", "deletionTimestamp": "2026-01-01T12:00:00Z"}}, True),
    (pods.is_deleted, _pod(), False),
])
def test_accessors(accessor: Any, pod: dict[str, Any], expected: Any) -> None:
    assert accessor(pod) == expected


@pytest.mark.parametrize("status,expected", [
    ({"state": TERMINATED}, TERMINATED["terminated"]),
    ({"state": {"running": {}}, "lastState": TERMINATED}, TERMINATED["terminated"]),   # restarted since
    ({"state": {"terminated": {}}, "lastState": TERMINATED}, TERMINATED["terminated"]),
    ({"state": "junk", "lastState": {}}, None),
    ({}, None),
    (None, None),
])
def test_last_termination(status: Any, expected: Any) -> None:
    assert pods.last_termination(status) == expected


def test_container_status_and_reports() -> None:
    p = _pod({"containerStatuses": [{"name": "target", "restartCount": 1}],
              "initContainerStatuses": ["junk", {"name": "drafter", "restartCount": 2}]},
             spec={"initContainers": [{"name": "drafter"}]})
    p["metadata"].update(name="j-0", uid="u0")
    status = {"reports": {"u0": {"pod": "j-0", "a": '{"step": 3}', "b": "[1]", "c": "{",
                                 "d": "x" * (MAX_REPORT_CHARS + 1)}}}
    assert pods.container_status(p, "target") == {"name": "target", "restartCount": 1}
    assert pods.container_status(p, "drafter") is None
    assert pods.container_status(p, "drafter", init=True) == {"name": "drafter", "restartCount": 2}
    assert pods.has_init_container(p, "drafter") and not pods.has_init_container(p, "mps-daemon")
    assert pods.report(status, p, "a") == {"step": 3}
    assert [pods.report(status, p, k) for k in "bcde"] == [None, None, None, None]
    assert pods.report({"reports": {"u0": {"pod": "j-1", "a": '{"step": 3}'}}}, p, "a") is None, "another pod's"
