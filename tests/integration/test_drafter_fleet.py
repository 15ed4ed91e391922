"""Four drafter sidecars as one fleet (pipeline 2 x data 2), each a real process next to a
synthetic target of its own (real rings, real loopback sockets, one run directory per pod as on a
cluster without a shared volume).

Ranks 1 and 3 are last stages: only their rings carry samples. Checked: the first stages' drafters
get those samples and train in their own windows; every replica is combined into the versions the
coordinator (rank 3, the exporting rank) exports; an insider (this process, holding the job's key
and pod 2's identity, as a compromised drafter of rank 2) that speaks as other ranks or sends a
combined version is refused and counted while the rounds go on; a SIGKILLed drafter blocks nobody
(rounds go on without it) and, restarted, rejoins from the newest combined version.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from spectrain_api.fleet_identity import IDENTITY_ITEM, PEERS_ITEM, load_identity, load_peers
from spectrain_api.names import ENV_FLEET_KEY_FILE, ENV_JOB_UID, ENV_RESTART_GENERATION
from spectrain_workloads.drafter.auth import Identity, client_handshake, load_key
from spectrain_workloads.drafter.export import load_drafter
from spectrain_workloads.drafter.fleet_records import pack_params
from spectrain_workloads.drafter.identity import PodIdentity, version_digest
from spectrain_workloads.drafter.synthetic import SyntheticSpec, SyntheticTarget, WindowSpec
from tests.fleet_ids import write_identities
from tests.integration.drafter_procs import Pod, synthetic_target
from tests.launch import free_ports
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

WORLD, PIPELINE, COORDINATOR = 4, 2, 3
UID = "fleet-test-uid"
TIMEOUT = 240


def _pods(root: Path) -> list[Pod]:
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(WORLD))
    key = root / "fleet.key"                 # the job's key, as the operator's Secret mounts it
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)                          # load_key refuses a key others can read
    ids = write_identities(root, WORLD, UID)  # each pod's identity Secret (one rank per pod)
    target = {"nodes": WORLD, "parallelism": {"data": 2, "pipeline": PIPELINE, "microbatches": 2},
              "checkpoint": {"claimName": "run"}}      # the processes share one run directory
    drafter = {"activation": {"safetyMarginMs": 1}, "exchange": {"combineEverySeconds": 1}}
    return [Pod(root / f"pod-{r}", drafter=drafter, target=target,
                settings={"checkpoint_every_s": 1.0, "verify_every_s": 1.0, "samples_per_step": 4},
                env={"RANK": str(r), "WORLD_SIZE": str(WORLD), "SPECTRAIN_DRAFTER_PEERS": peers,
                     "SPECTRAIN_DRAFTER_BIND": "127.0.0.1", ENV_FLEET_KEY_FILE: str(key),
                     ENV_JOB_UID: UID, ENV_RESTART_GENERATION: "0", **ids[r]})
            for r in range(WORLD)]


def _targets(pods: list[Pod]) -> list[SyntheticTarget]:
    out = []
    for r, pod in enumerate(pods):
        last = r % PIPELINE == PIPELINE - 1
        spec = SyntheticSpec(windows=[WindowSpec(kind="Bubble", duration_ms=150.0)], compute_ms=2.0,
                             data_per_step=2 if last else 0, seq_len=64, seed=0)
        out.append(synthetic_target(pod, spec))
    return out


def _drive(targets: list[SyntheticTarget], pods: list[Pod], until: Any, what: str, timeout: float = TIMEOUT) -> Any:
    def step() -> Any:
        for r, pod in enumerate(pods):
            if pod.proc is not None and pod.proc.poll() is not None:
                raise RuntimeError(f"drafter {r} exited ({pod.proc.returncode}):\n{pod.log_text()[-2000:]}")
        for t in targets:
            t.run_step()
        return until()
    return wait_for(step, timeout=timeout, interval=0, what=what)


def _summary(pod: Pod, rank: int) -> dict[str, Any]:
    try:
        return pod.summary(rank)
    except (FileNotFoundError, ValueError):
        return {}


def _insider(root: Path, pods: list[Pod], targets: list[SyntheticTarget]) -> None:
    """A compromised drafter of pod 2 (rank 2), with the job's key and its own pod's identity read from
    its files: it claims rank 1 (rank 0's sample source) and rank 3 (the coordinator) to rank 0 and
    rank 0 to the coordinator, refused for their identity (the listener closes the connection); as
    itself it sends rank 0 a combined version it signed, refused for its role. All counted, rounds go on."""
    ids = root / "identity" / "2"
    pod = PodIdentity(load_identity(ids / IDENTITY_ITEM), load_peers(ids / PEERS_ITEM, UID, 0))
    ident = Identity(load_key(root / "fleet.key"), UID, 0, pod)
    ports = [int(a.rpartition(":")[2]) for a in pods[0].extra_env["SPECTRAIN_DRAFTER_PEERS"].split(",")]
    model, _ = load_drafter(pods[COORDINATOR].run_dir / "drafter")
    payload = pack_params({n: p.detach() * 1e6 for n, p in model.named_parameters() if p.requires_grad})

    def rejected(rank: int) -> dict[str, int]:
        return dict(_summary(pods[rank], rank).get("exchangeRejectedByCause", {}))
    before = {r: rejected(r) for r in (0, COORDINATOR)}
    version = _summary(pods[0], 0)["combinedVersion"] + 1
    combined = {"version": version, "included": {"2": 1}, "work_s": 1.0,
                "signature": pod.sign(version_digest(UID, 0, version, payload)).hex()}
    for as_rank, to in ((1, 0), (COORDINATOR, 0), (0, COORDINATOR), (2, 0)):
        with socket.create_connection(("127.0.0.1", ports[to]), timeout=10) as s:
            session = client_handshake(s, ident, as_rank, to)    # the listener judges the proof after it
            head, tag = session.seal("combined", json.dumps(combined).encode(), payload)
            with contextlib.suppress(ConnectionError):           # refused: the listener closed it
                s.sendall(head + payload + tag)

    def counted() -> bool:
        now = {r: rejected(r) for r in (0, COORDINATOR)}
        grew = {(r, c): now[r].get(c, 0) - before[r].get(c, 0) for r in now for c in ("identity", "role")}
        return grew[(0, "identity")] >= 2 and grew[(COORDINATOR, "identity")] >= 1 and grew[(0, "role")] >= 1
    _drive(targets, pods, counted, "the insider's claims refused for their identity, its version for its role")
    _drive(targets, pods, lambda: _summary(pods[0], 0)["combinedVersion"] >= version + 1,
           "rank 0 takes the real coordinator's versions after the insider's")


def test_four_drafters_share_samples_combine_and_survive_a_sigkill(tmp_path: Path) -> None:
    pods = _pods(tmp_path)
    targets = _targets(pods)
    for pod in pods:
        pod.start_drafter()
    try:
        def all_combined() -> bool:
            s = [_summary(p, r) for r, p in enumerate(pods)]
            rounds = pods[COORDINATOR].of_rank("combined", COORDINATOR)
            exported = s[COORDINATOR].get("exportSamplesByRank", {})
            return (all(x.get("harvestedSeconds", 0) > 0 and x.get("combinedVersion", 0) >= 2 for x in s)
                    and any(set(e["ranks"]) == {0, 1, 2, 3} for e in rounds)
                    and len(exported) == 4 and all(n > 0 for n in exported.values()))
        _drive(targets, pods, all_combined, "every drafter trained, a round of all four, two versions applied, "
               "every rank's samples in the coordinator's exports")
        s = [_summary(p, r) for r, p in enumerate(pods)]
        assert [x["fleetRole"] for x in s] == ["member"] * 3 + ["coordinator"]
        for r in (0, 2):            # first stages: no data of their own, the last stages' samples
            assert s[r]["samplesFromPeers"] > 0 and s[r]["samplesTrained"] > 0 and s[r]["samplesShared"] == 0
        for r in (1, 3):
            assert s[r]["samplesShared"] > 0 and s[r]["samplesFromPeers"] == 0
        _insider(tmp_path, pods, targets)

        pods[0].proc.send_signal(signal.SIGKILL)        # type: ignore[union-attr]
        pods[0].proc.wait()                             # type: ignore[union-attr]
        pods[0].proc = None
        # the coordinator's own log, not its summary (written every few seconds, rounds behind)
        at_kill = max((e["version"] for e in pods[COORDINATOR].of_rank("combined", COORDINATOR)), default=0)
        work_at_kill = {r: _summary(pods[r], r)["harvestedSeconds"] for r in (1, 2)}

        def later_rounds() -> list[dict[str, Any]]:
            # the first round after the kill may still hold rank 0's last contribution (in flight)
            return [e for e in pods[COORDINATOR].of_rank("combined", COORDINATOR) if e["version"] >= at_kill + 2]

        def goes_on() -> bool:
            return bool(later_rounds()) and all(_summary(pods[r], r)["harvestedSeconds"] > work_at_kill[r]
                                                for r in (1, 2))
        _drive(targets, pods, goes_on, "two more rounds and more work without rank 0")
        after = later_rounds()
        assert all(0 not in e["ranks"] for e in after) and {1, 2, 3} <= set(after[-1]["ranks"]), after

        pods[0].start_drafter()
        restarted_at = _summary(pods[COORDINATOR], COORDINATOR)["combinedVersion"]

        def rejoined() -> bool:
            setups = pods[0].of_rank("setup", 0)
            combined = [e for e in pods[0].of_rank("combined", 0) if e["version"] >= restarted_at]
            return len(setups) == 2 and bool(combined)
        _drive(targets, pods, rejoined, "the restarted drafter's setup and a combined version after it")
        rounds = pods[COORDINATOR].of_rank("combined", COORDINATOR)
        _drive(targets, pods, lambda: any(0 in e["ranks"] for e in pods[COORDINATOR].of_rank("combined", COORDINATOR)
                                          if e["version"] > rounds[-1]["version"]),
               "rank 0's contributions back in a round")
    finally:
        for pod in pods:
            if pod.proc is not None and pod.proc.poll() is None:
                pod.stop_drafter(signal.SIGTERM, timeout=60)
            pod.kill()
        for t in targets:
            t.close()
    # the export is the newest of the coordinator's versions the export gate accepted (every later one
    # refused with a cause), versions monotone
    model, meta = load_drafter(pods[COORDINATOR].run_dir / "drafter")
    versions = [e["version"] for e in pods[COORDINATOR].of_rank("checkpoint", COORDINATOR)]
    assert versions == sorted(versions) and meta["version"] == pods[COORDINATOR].of_rank("export", COORDINATOR)[-1]["version"]
    refused = {e["version"] for e in pods[COORDINATOR].of_rank("export_rejected", COORDINATOR)}
    assert {v for v in versions if v > meta["version"]} <= refused, (versions, meta["version"], refused)
