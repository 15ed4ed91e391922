"""The drafter next to the real target (2 pipeline ranks, gloo on CPU): learning in harvested
windows, isolation and crash recovery.

Runs of the same job: `off` (SPECTRAIN_DRAFTER_ENABLED=0, no drafter, nothing published),
`on` (a drafter sidecar per pod, policy IdleOnly, exchanging samples and combining their
replicas over loopback (drafter.fleet); the last stage's is SIGKILLed mid-run and restarted) and
`disabled` (drafters disabled in place mid-run through their control files, as the operator does
past drafter.maxFailures). The target is sized like examples/demo.yaml so that its pipeline bubbles (one
microbatch's forward + backward of the other stage) are many drafter units long. Checked: the
target's losses and final weights are bitwise identical; the drafter worked only inside the
target's windows; the restarted drafter resumed from its last complete checkpoint; and its export
predicts the final target on held-out text clearly better than an untrained drafter; a disabled
drafter stops, lets go of the ring, says so and stays up until SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spectrain_api import rundir
from spectrain_api.fleet_identity import IDENTITY_ITEM, PEERS_ITEM
from spectrain_api.names import (
    ANNOTATION_DRAFTER_DISABLED,
    ENV_DRAFTER_CONTROL,
    ENV_FLEET_IDENTITY_FILE,
    ENV_FLEET_KEY_FILE,
    ENV_FLEET_PEERS_FILE,
    ENV_JOB_UID,
)
from spectrain_operator.local_layout import free_port
from tests.fleet_ids import write_identities
from tests.integration.drafter_procs import REPO, read_jsonl
from tests.launch import launch_local, node_ring_dir, stop, wait_all
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

STEPS = 48
SEQ = 128
N_LAYERS = 8
BASE_ENV = {"SPECTRAIN_DATA_MAX_BYTES": str(1 << 20), "SPECTRAIN_PUBLISH_FRACTION": "0.5"}
MS = 1_000_000
SLACK_NS = 5 * MS     # poll-to-start latency and clock reads around a task, on a loaded machine


def _config(path: Path) -> Path:
    path.write_text(json.dumps({"metadata": {"name": "t"}, "spec": {"mode": "Pretrain", "seed": 7, "target": {
        "image": "x", "nodes": 2, "procsPerNode": 1,
        "parallelism": {"data": 1, "pipeline": 2, "microbatches": 4, "schedule": "1F1B"},
        "model": {"preset": "debug", "overrides": {"n_layers": N_LAYERS}},
        "data": {"source": "builtin:python-stdlib", "seqLen": SEQ, "batchSize": 16},
        "optimizer": {"name": "AdamW", "lr": 0.003}, "steps": STEPS,
        "checkpoint": {"everySteps": STEPS, "keep": 2, "claimName": "run"}},
        "drafter": {"activation": {"policy": "IdleOnly", "safetyMarginMs": 1},
                    "exchange": {"combineEverySeconds": 1}}}}))
    return path


def _drafter(root: Path, cfg: Path, node: int, peers: str, control: Path | None = None) -> subprocess.Popen[bytes]:
    key = root / "fleet.key"                 # the job's key, as the operator's Secret mounts it
    if not key.exists():
        key.write_text(os.urandom(32).hex() + "\n")
        key.chmod(0o600)                     # load_key refuses a key others can read
        write_identities(root, 2, "drafter-target-test")     # each pod's identity Secret, one per node
    ids = root / "identity" / str(node)
    env = {ENV_FLEET_IDENTITY_FILE: str(ids / IDENTITY_ITEM), ENV_FLEET_PEERS_FILE: str(ids / PEERS_ITEM),**({ENV_DRAFTER_CONTROL: str(control)} if control else {}), ENV_FLEET_KEY_FILE: str(key),
           ENV_JOB_UID: "drafter-target-test", "SPECTRAIN_DRAFTER_PEERS": peers, "SPECTRAIN_DRAFTER_BIND": "127.0.0.1", **os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "workloads"), os.environ.get("PYTHONPATH", "")]),
           "SPECTRAIN_CONFIG": str(cfg), "SPECTRAIN_RING_DIR": str(node_ring_dir(root / "ring", node, 2)),
           "SPECTRAIN_RUN_DIR": str(root), "SPECTRAIN_DEVICE": "cpu", "RANK": str(node), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "1",
           "SPECTRAIN_DRAFTER_SETTINGS": json.dumps({"checkpoint_every_s": 0.3, "samples_per_step": 4,
                                                     "verify_every_s": 1.0})}
    log = open(root / f"drafter-{node}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "spectrain_workloads.drafter.sidecar"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def _final_weights(root: Path, rank: int) -> dict[str, torch.Tensor]:
    state = torch.load(root / "target" / f"rank-{rank}" / f"step-{STEPS}" / "state.pt", map_location="cpu",
                       weights_only=False)
    return state["model"]


def _losses(root: Path, rank: int) -> list[Any]:
    return [line["loss"] for line in read_jsonl(root / "metrics" / f"target-rank-{rank}.jsonl")]


@pytest.fixture(scope="module")
def off(tmp_path_factory: pytest.TempPathFactory) -> Path:
    off = tmp_path_factory.mktemp("off")
    procs = launch_local(_config(off / "cfg.json"), 2, off, off / "ring",
                         env={**BASE_ENV, "SPECTRAIN_DRAFTER_ENABLED": "0"})
    assert wait_all(procs, 240) == [0, 0]
    return off


def _peers() -> str:
    used: set[int] = set()
    for _ in range(2):
        used.add(free_port(exclude=used))
    return ",".join(f"127.0.0.1:{p}" for p in sorted(used))


def _assert_target_unchanged(on: Path, off: Path) -> None:
    for rank in (0, 1):
        assert _losses(on, rank) == _losses(off, rank) and len(_losses(on, rank)) == STEPS
        a, b = _final_weights(on, rank), _final_weights(off, rank)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, off: Path) -> dict[str, Any]:
    on = tmp_path_factory.mktemp("on")
    cfg = _config(on / "cfg.json")
    events = rundir.drafter_metrics(on, 1)
    info: dict[str, Any] = {"off": off, "on": on}
    procs: list[subprocess.Popen[bytes]] = []
    # The drafters first: once they wait for the ring (torch imported), the target starts; it
    # writes its embedding / LM head before step 0, so the drafters can train from the first step.
    peers = _peers()
    drafters = [_drafter(on, cfg, n, peers) for n in range(2)]
    try:
        wait_for(lambda: all(rundir.drafter_summary(on, n).exists() for n in range(2)), 120,
                 what="both drafters up and waiting for the ring")
        procs = launch_local(cfg, 2, on, on / "ring", env=BASE_ENV)
        wait_for(lambda: [e for e in read_jsonl(events) if e["event"] == "checkpoint" and e["version"] >= 2],
                 120, interval=0.05, what="two checkpoints of the last stage's drafter")
        drafters[1].send_signal(signal.SIGKILL)          # mid-run, without warning
        drafters[1].wait()
        info["killed_at_step"] = len(_losses(on, 1))
        info["newest"] = max(e["version"] for e in read_jsonl(events) if e["event"] == "checkpoint")
        drafters[1] = _drafter(on, cfg, 1, peers)
        info["codes"] = wait_all(procs, 240)
        info["setups"] = wait_for(lambda: [e for e in read_jsonl(events) if e["event"] == "setup"][1:], 60,
                                  what="the restarted drafter's setup")
        for d in drafters:
            d.send_signal(signal.SIGTERM)
        info["drafter_codes"] = [d.wait(timeout=60) for d in drafters]
    finally:
        stop(procs, grace_s=0)
        for d in drafters:
            if d.poll() is None:
                d.kill()
                d.wait()
    return info


def test_target_is_bitwise_identical_with_the_drafter_on_and_off(runs: dict[str, Any]) -> None:
    off, on = runs["off"], runs["on"]
    assert runs["codes"] == [0, 0] and runs["drafter_codes"] == [0, 0]
    assert runs["killed_at_step"] < STEPS, "the drafter was killed mid-run"
    _assert_target_unchanged(on, off)
    # the drafter did train next to it, on the target's published data
    s = json.loads(rundir.drafter_summary(on, 1).read_text())
    assert s["samplesTrained"] > 0 and s["dataReceived"] > 0 and s["policy"] == "IdleOnly"
    assert not (off / "drafter").exists()


def test_killed_drafter_resumes_from_its_last_complete_checkpoint(runs: dict[str, Any]) -> None:
    on = runs["on"]
    resumed = runs["setups"][0]
    assert resumed["resumed_version"] == runs["newest"]
    ckpts = sorted(p.name for p in (on / "drafter" / "rank-1").iterdir())
    assert all(not n.startswith(".tmp-") for n in ckpts)
    # stage 0's ring has windows but no data: the last stage's samples reach its drafter, which
    # trains in stage 0's windows, and its replica is combined into the exported model
    s0 = json.loads(rundir.drafter_summary(on, 0).read_text())
    assert s0["samplesFromPeers"] > 0 and s0["samplesTrained"] > 0 and s0["harvestedSeconds"] > 0, s0
    assert s0["combinedVersion"] >= 1 and s0["combinedWorkSeconds"] > 0, s0


def _final_target(root: Path) -> Any:
    from spectrain_workloads.model import Transformer, model_config

    cfg = model_config("debug", {"n_layers": N_LAYERS}, vocab_size=264)
    model = Transformer(cfg)
    state = {**_final_weights(root, 0), **_final_weights(root, 1)}   # stage keys are the full model's
    model.load_state_dict(state)
    return model.eval()


def test_drafter_learns_from_the_real_target_only_in_its_windows(runs: dict[str, Any]) -> None:
    from spectrain_workloads.drafter.export import load_drafter
    from spectrain_workloads.drafter.models import EagleDrafter, build_drafter
    from spectrain_workloads.drafter.settings import DrafterSettings
    from spectrain_workloads.drafter.synthetic import target_hidden, text_sequences
    from spectrain_workloads.drafter.verify import measure

    on = runs["on"]
    # Both ranks' drafters: the restarted one (rank 1) may come back only near the end of the run
    # (a process start and torch's imports under load take as long as the whole 48-step target),
    # so the job's drafters together must have trained, each rank inside its own target's windows.
    # (Work records are written when their window closes: a SIGKILLed drafter loses those of open
    # windows; its training counters survive in its checkpoints and reach the summary.)
    summaries = {r: json.loads(rundir.drafter_summary(on, r).read_text()) for r in (0, 1)}
    assert sum(s["microSteps"] for s in summaries.values()) >= 20, summaries
    kinds: set[str] = set()
    for rank in (0, 1):
        windows = {w["window_id"]: w for w in read_jsonl(on / "metrics" / f"windows-rank-{rank}.jsonl")}
        work = [e for e in read_jsonl(rundir.drafter_metrics(on, rank)) if e["event"] == "work"]
        for rec in work:   # IdleOnly: every task inside one of the target's windows, overrun <= one task
            w = windows[rec["window_id"]]
            assert rec["start_ns"] >= w["start_ns"], (rank, rec)
            assert rec["end_ns"] - (w["start_ns"] + w["actual_ns"]) <= rec["last_task_ns"] + SLACK_NS, (rank, rec, w)
        kinds |= {windows[r["window_id"]]["kind"] for r in work}
    assert kinds >= {"Bubble"}, summaries

    # The export vs an untrained drafter with the same frozen embedding / head, on held-out text
    # through the final target (what a speculative decoder would verify against).
    drafter, meta = load_drafter(on / "drafter")
    assert meta["arch"] == "Eagle"
    target = _final_target(on)
    tokens = text_sequences(8, 64, seed=1234)
    hidden = target_hidden(target, tokens)
    data = [(tokens[i], hidden[i]) for i in range(len(tokens))]
    fresh = build_drafter(DrafterSettings(seed=7), target.cfg)
    assert isinstance(fresh, EagleDrafter)
    fresh.load_target_weights(target.tok_embeddings.weight, target.output.weight)
    drafter.load_target_weights(target.tok_embeddings.weight, target.output.weight)
    trained, untrained = measure(drafter, data, None, k=4), measure(fresh, data, None, k=4)
    assert trained.top1 > untrained.top1 + 0.1, (trained.to_dict(), untrained.to_dict())
    assert trained.acceptance_length > untrained.acceptance_length, (trained.to_dict(), untrained.to_dict())


def _summary(root: Path, rank: int) -> dict[str, Any]:
    try:
        return json.loads(rundir.drafter_summary(root, rank).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def test_drafters_disabled_in_place_idle_and_the_target_is_unchanged(off: Path, tmp_path: Path) -> None:
    """The operator's annotation reaches the sidecars mid-run (their downward-API files, replaced
    atomically like the kubelet does): they stop, leave the ring and the fleet, report
    Disabled/DisabledByOperator and stay up; the target's steps go on, bitwise as without a drafter."""
    root = tmp_path
    cfg = _config(root / "cfg.json")
    controls = [root / f"podinfo-{n}" / "annotations" for n in range(2)]
    for c in controls:
        c.parent.mkdir()
        c.write_text('kubectl.kubernetes.io/default-container="target"\n')
    peers = _peers()
    drafters = [_drafter(root, cfg, n, peers, controls[n]) for n in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        wait_for(lambda: all(_summary(root, n) for n in range(2)), 120, what="both drafters up")
        procs = launch_local(cfg, 2, root, root / "ring", env=BASE_ENV)
        events = rundir.drafter_metrics(root, 1)
        wait_for(lambda: [e for e in read_jsonl(events) if e["event"] == "checkpoint"], 120, interval=0.05,
                 what="the last stage's drafter trained")
        for c in controls:
            tmp = c.with_name(".annotations.tmp")
            tmp.write_text(c.read_text() + f'{ANNOTATION_DRAFTER_DISABLED}="DrafterCrashLoop"\n')
            os.replace(tmp, c)
        at_step = len(_losses(root, 1))
        disabled = wait_for(lambda: all(_summary(root, n).get("reason") == "DisabledByOperator" for n in range(2))
                            and [_summary(root, n) for n in range(2)], 30, what="both drafters disabled")
        assert at_step < STEPS, "the drafters were disabled mid-run"
        assert wait_all(procs, 240) == [0, 0]
        assert [d.poll() for d in drafters] == [None, None], "a disabled drafter stays up (a native sidecar)"
        for n, d in enumerate(drafters):
            ring = node_ring_dir(root / "ring", n, 2) / "ring-0"
            assert str(ring) not in Path(f"/proc/{d.pid}/maps").read_text(), "the ring is let go"
        codes = []
        for d in drafters:
            d.send_signal(signal.SIGTERM)
            codes.append(d.wait(timeout=60))
        assert codes == [0, 0]
    finally:
        stop(procs, grace_s=0)
        for d in drafters:
            if d.poll() is None:
                d.kill()
                d.wait()
    _assert_target_unchanged(root, off)
    for n in range(2):
        s = _summary(root, n)
        assert s["state"] == "Disabled" and s["reason"] == "DisabledByOperator", s
        assert s["microSteps"] == disabled[n]["microSteps"], "no work after it was disabled"
        evs = read_jsonl(rundir.drafter_metrics(root, n))
        cut = next(i for i, e in enumerate(evs) if e["event"] == "disabled")
        assert not [e for e in evs[cut:] if e["event"] in ("work", "checkpoint", "export", "acceptance")], evs[cut:]
