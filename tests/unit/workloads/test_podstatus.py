"""podstatus: atomic files always; in-cluster PATCH of the job's status.reports.<pod UID>, throttled; never raises.

The API server here is a plain-HTTP stand-in that records requests; tests/integration/test_status_path.py
runs the same code against a real kube-apiserver under the job's own Role."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from spectrain_api import rundir
from spectrain_api.names import MAX_REPORT_CHARS
from spectrain_workloads import podstatus
from tests.waiting import wait_for

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _reset(monkeypatch: pytest.MonkeyPatch) -> None:
    podstatus._last_patch.clear()
    podstatus._in_flight.clear()
    podstatus._flushed.clear()
    for var in ("SPECTRAIN_POD_NAME", "SPECTRAIN_POD_NAMESPACE", "SPECTRAIN_POD_UID", "SPECTRAIN_JOB_NAME",
                "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)


def api_server(on_patch: Callable[[BaseHTTPRequestHandler, bytes], None]) -> ThreadingHTTPServer:
    """A plain-HTTP stand-in for the API server, serving in a thread: every PATCH goes to
    `on_patch(handler, body)`, then is answered 200 {}. Call .shutdown() when done."""

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:  # noqa: N802
            on_patch(self, self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_files_are_written_atomically_with_nan_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECTRAIN_RUN_DIR", str(tmp_path))
    podstatus.report_progress({"step": 3, "totalSteps": 10, "loss": float("nan"), "tokensPerSecond": 5.0})
    podstatus.report_drafter({"state": "Active", "harvestedSeconds": 1.0}, rank=2)
    prog = json.loads((tmp_path / "progress.json").read_text())
    assert prog["step"] == 3 and prog["loss"] is None and prog["updatedAt"]
    assert json.loads(rundir.drafter_summary(tmp_path, 2).read_text())["state"] == "Active"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECTRAIN_RUN_DIR", str(blocker / "sub"))  # cannot be created
    podstatus.report_progress({"step": 1})
    podstatus.report_drafter({"state": "Waiting"}, rank="x")  # type: ignore[arg-type]


def test_in_cluster_patch_of_the_job_status_report_throttled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str, dict[str, Any], str]] = []
    server = api_server(lambda h, body: seen.append(
        (h.path, h.headers["Content-Type"], json.loads(body), h.headers["Authorization"])))
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok\n")
    monkeypatch.setattr(podstatus, "SA_DIR", sa)
    monkeypatch.setenv("SPECTRAIN_POD_NAME", "job-0")
    monkeypatch.setenv("SPECTRAIN_POD_NAMESPACE", "ns")
    monkeypatch.setenv("SPECTRAIN_POD_UID", "uid-0")
    monkeypatch.setenv("SPECTRAIN_JOB_NAME", "job")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.server_port))
    monkeypatch.setenv("SPECTRAIN_RUN_DIR", str(tmp_path / "run"))
    # plain HTTP test server: let the https URL reach it
    real = podstatus._in_cluster()
    assert real is not None and real.server == f"https://127.0.0.1:{server.server_port}" and real.uid == "uid-0"
    monkeypatch.setattr(podstatus, "_in_cluster",
                        lambda: dataclasses.replace(real, server=f"http://127.0.0.1:{server.server_port}"))
    try:
        podstatus.report_progress({"step": 1})
        wait_for(lambda: len(seen) == 1, 5, what="first PATCH")
        podstatus.report_progress({"step": 2})  # within 10 s: file only
        assert json.loads((tmp_path / "run" / "progress.json").read_text())["step"] == 2
        podstatus.report_progress({"step": 3}, flush=True)
        wait_for(lambda: len(seen) == 2, 5, what="flushed PATCH")
    finally:
        server.shutdown()
    path, ctype, body, auth = seen[-1]
    assert path == "/apis/spectrain.io/v1alpha1/namespaces/ns/spectrainjobs/job/status"
    assert ctype == "application/merge-patch+json" and auth == "Bearer tok"
    (report,) = body["status"]["reports"].values()
    assert list(body["status"]["reports"]) == ["uid-0"] and report["pod"] == "job-0"
    assert json.loads(report["progress"])["step"] == 3


def test_a_flush_while_a_patch_is_in_flight_is_sent_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last report (flush=True) arrives while the previous PATCH is still unanswered: it must
    still reach the pod, after that one, and not be dropped as throttled."""
    seen: list[int] = []
    release = threading.Event()

    def on_patch(_: BaseHTTPRequestHandler, body: bytes) -> None:
        seen.append(json.loads(json.loads(body)["status"]["reports"]["u"]["progress"])["step"])
        release.wait(10)          # the first PATCH stays in flight until the test lets it go

    server = api_server(on_patch)
    where = podstatus.Where(f"http://127.0.0.1:{server.server_port}", "ns", "job", "p", "u", "t")
    monkeypatch.setattr(podstatus, "_in_cluster", lambda: where)
    monkeypatch.setenv("SPECTRAIN_RUN_DIR", str(tmp_path / "run"))
    try:
        podstatus.report_progress({"step": 1})
        wait_for(lambda: seen == [1], 5, what="first PATCH at the server")
        podstatus.report_progress({"step": 2})                 # throttled: the file only
        podstatus.report_progress({"step": 3}, flush=True)     # while step 1's PATCH is in flight
        release.set()
        wait_for(lambda: seen == [1, 3], 5, what="the flushed PATCH after the in-flight one")
        wait_for(lambda: not podstatus._in_flight, 5, what="no PATCH in flight")
    finally:
        server.shutdown()


def test_a_report_over_the_bound_is_not_sent_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A report whose JSON exceeds MAX_REPORT_CHARS (the CRD's bound, which the API server would refuse)
    is not sent: the file still has it, one warning names the size and the bound, training goes on."""
    seen: list[bytes] = []
    server = api_server(lambda _, body: seen.append(body))
    where = podstatus.Where(f"http://127.0.0.1:{server.server_port}", "ns", "job", "p", "u", "t")
    monkeypatch.setattr(podstatus, "_in_cluster", lambda: where)
    monkeypatch.setattr(podstatus, "_warned", False)
    monkeypatch.setenv("SPECTRAIN_RUN_DIR", str(tmp_path / "run"))
    try:
        with caplog.at_level("WARNING", logger="spectrain.podstatus"):
            podstatus.report_drafter({"state": "Active", "artifact": "x" * MAX_REPORT_CHARS}, rank=0, flush=True)
            wait_for(lambda: not podstatus._in_flight, 5, what="the PATCH thread done")
        assert seen == []
        assert f"over {MAX_REPORT_CHARS}" in caplog.text and "drafter report" in caplog.text
        assert json.loads(rundir.drafter_summary(tmp_path / "run", 0).read_text())["state"] == "Active"
    finally:
        server.shutdown()


def test_drain_waits_for_the_last_report_before_the_process_exits(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The PATCH thread is a daemon: a process that exits right after its last report would drop it.
    `drain` holds the exit until the flushed report is answered, and gives up after its timeout."""
    seen: list[int] = []
    release = threading.Event()

    def on_patch(_: BaseHTTPRequestHandler, body: bytes) -> None:
        release.wait(10)
        seen.append(json.loads(json.loads(body)["status"]["reports"]["u"]["drafter"])["version"])

    server = api_server(on_patch)
    where = podstatus.Where(f"http://127.0.0.1:{server.server_port}", "ns", "job", "p", "u", "t")
    monkeypatch.setattr(podstatus, "_in_cluster", lambda: where)
    monkeypatch.setenv("SPECTRAIN_RUN_DIR", str(tmp_path / "run"))
    try:
        assert podstatus.drain(0.1)                                  # nothing in flight: at once
        podstatus.report_drafter({"version": 1}, rank=0)
        podstatus.report_drafter({"version": 2}, rank=0, flush=True)   # queued behind the in-flight one
        assert not podstatus.drain(0.2) and seen == []                 # the server holds it: not sent yet
        threading.Timer(0.3, release.set).start()
        assert podstatus.drain(5.0) and seen == [1, 2]
    finally:
        release.set()
        server.shutdown()
