"""Bad inputs to `spectrain run` / `spectrain report` give clear errors naming what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from spectrain_operator import local_layout
from spectrain_workloads import report

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("docs", [[], [{"kind": "ConfigMap"}], ["job", "job"]], ids=["empty", "no-job", "two-jobs"])
def test_run_needs_exactly_one_spectrainjob(tmp_path: Path, docs: list) -> None:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump_all([job if d == "job" else d for d in docs]))
    with pytest.raises(SystemExit, match=r"expected exactly one SpecTrainJob, found \d"):
        local_layout.load_manifest(path)


def test_empty_target_command_falls_back_to_the_workload_entrypoint(tmp_path: Path) -> None:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["target"]["command"] = []
    job["spec"]["drafter"]["enabled"] = False
    plan = local_layout.plan(job, tmp_path / "r")
    assert [Path(c.argv[0]).name for c in plan.containers] == ["spectrain-target"] * 2


def test_report_of_a_directory_without_metrics_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no metrics/ found; pass the --run-dir"):
        report.build_report(tmp_path)


def test_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    # An ephemeral port can be taken as an outgoing connection's source port before the local
    # process binds it (a metrics server after the gloo mesh failed with EADDRINUSE that way).
    import socket

    from spectrain_operator.local_layout import _ephemeral_low, free_port

    for _ in range(20):
        port = free_port()
        assert 10000 <= port < min(_ephemeral_low(), 30000)
        with socket.socket() as s:
            s.bind(("", port))
    handed_out = set(range(10000, 30000, 2))      # ports given to processes that have not bound them yet
    assert all(free_port(exclude=handed_out) not in handed_out for _ in range(50))


def test_local_pods_give_each_pods_drafters_their_own_loopback_ports(tmp_path: Path) -> None:
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["target"].update(nodes=2, procsPerNode=2)
    job["spec"]["target"]["parallelism"].update(data=2, pipeline=2)
    run = local_layout.plan(job, tmp_path / "run", shm_dir=tmp_path / "shm")
    drafters = [c for c in run.containers if c.name == "drafter"]
    assert len(drafters) == 2
    peers = {c.env["SPECTRAIN_DRAFTER_PEERS"] for c in drafters}
    assert len(peers) == 1, "every drafter must see the same addresses"
    ports = [int(a.rsplit(":", 1)[1]) for a in peers.pop().split(",")]
    assert len(ports) == 2 and abs(ports[0] - ports[1]) >= 2      # local ranks 0, 1 of each pod: base + i
    assert all(c.env["SPECTRAIN_DRAFTER_BIND"] == "127.0.0.1" for c in drafters)
    assert all(c.env["SPECTRAIN_POD_IP"] == "127.0.0.1" for c in run.containers)   # what listeners bind
    assert not any("SPECTRAIN_DRAFTER_PEERS" in c.env for c in run.containers if c.name == "target")


def test_local_subpath_mounts_are_directories_inside_their_volumes(tmp_path: Path) -> None:
    """The drafter's read-write subPaths of the run volume (drafter/, an export path of its own) map to
    those directories of the run volume's host directory, made as the kubelet makes them; the
    read-only rest is the same directory (readOnly is not enforced locally: no mount namespaces)."""
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["drafter"]["export"] = {"path": "models/eagle"}
    run = local_layout.plan(job, tmp_path / "r", shm_dir=tmp_path / "shm")
    volume = tmp_path / "r" / "pvc" / job["spec"]["target"]["checkpoint"]["claimName"]
    for c in run.containers:
        assert c.env["SPECTRAIN_RUN_DIR"] == str(volume)
        assert c.env["SPECTRAIN_EXPORT_DIR"] == str(volume / "models" / "eagle")
    assert (volume / "drafter").is_dir() and (volume / "models" / "eagle").is_dir()
    assert local_layout._mount_dir(volume, {"name": "run", "mountPath": "/x", "readOnly": True}) == volume
    assert local_layout._mount_dir(volume, {"name": "run", "mountPath": "/x/a/b", "subPath": "a/b"}) == volume / "a/b"
    assert (volume / "a" / "b").is_dir()


def test_local_emptydirs_are_private_to_their_pod_and_claims_are_shared(tmp_path: Path) -> None:
    """As a kubelet gives them: the run volume of a job without a claim is one directory per pod (a
    file the target of one pod writes there is not seen by another pod); with a claim it is one
    directory for every pod."""
    job = yaml.safe_load((ROOT / "examples" / "pretrain-dp.yaml").read_text())
    del job["spec"]["target"]["checkpoint"]["claimName"]
    run = local_layout.plan(job, tmp_path / "own", shm_dir=tmp_path / "shm")
    dirs = {c.pod: c.env["SPECTRAIN_RUN_DIR"] for c in run.containers if c.name == "target"}
    assert len(dirs) == 2 and len(set(dirs.values())) == 2
    assert all(d == str(tmp_path / "own" / "pods" / pod / "run") for pod, d in dirs.items())
    shared = yaml.safe_load((ROOT / "examples" / "pretrain-dp.yaml").read_text())
    run = local_layout.plan(shared, tmp_path / "shared", shm_dir=tmp_path / "shm")
    assert {c.env["SPECTRAIN_RUN_DIR"] for c in run.containers if "SPECTRAIN_RUN_DIR" in c.env} == {
        str(tmp_path / "shared" / "pvc" / "pretrain-dp-ckpt")}


def test_run_volume_names_the_fix_when_each_pod_has_its_own(tmp_path: Path) -> None:
    job = yaml.safe_load((ROOT / "examples" / "pretrain-dp.yaml").read_text())
    del job["spec"]["target"]["checkpoint"]["claimName"]
    local_layout.plan(job, tmp_path / "own", shm_dir=tmp_path / "shm")
    with pytest.raises(SystemExit, match=r"2 run volumes .*set spec.target.checkpoint.claimName"):
        local_layout.run_volume(tmp_path / "own")
    shared = yaml.safe_load((ROOT / "examples" / "pretrain-dp.yaml").read_text())
    local_layout.plan(shared, tmp_path / "shared", shm_dir=tmp_path / "shm")
    assert local_layout.run_volume(tmp_path / "shared") == tmp_path / "shared" / "pvc" / "pretrain-dp-ckpt"
