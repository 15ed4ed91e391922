"""The real drafter sidecars under attack: two sidecars (pipeline 2: rank 1 the last stage and the
exporting coordinator) next to synthetic targets, and an attacker holding the job's key and a pod's
identity (a compromised drafter: rank 1's pod towards rank 0, rank 0's towards the coordinator) sending them NaN and out-of-range samples, forged combined versions (a huge
norm, version 2^62) and forged contributions (huge norm, 1e30 s of work, foreign tensors).
Both sidecars stay up, rounds go on, everything refused is counted, and the export is finite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from spectrain_api.errors import ConfigError
from spectrain_api.fleet_identity import IDENTITY_ITEM, PEERS_ITEM, load_identity, load_peers
from spectrain_api.names import ENV_FLEET_KEY_FILE, ENV_JOB_UID, ENV_METRICS_PORT, ENV_RESTART_GENERATION
from spectrain_workloads.drafter.auth import Identity, client_handshake
from spectrain_workloads.drafter.export import load_drafter
from spectrain_workloads.drafter.fleet_records import pack_params
from spectrain_workloads.drafter.identity import PodIdentity, version_digest
from tests.fleet_ids import write_identities
from tests.integration.drafter_procs import TARGET_CFG, Pod
from tests.integration.test_drafter_fleet import _drive, _summary, _targets
from tests.launch import free_ports

pytestmark = pytest.mark.integration

WORLD, COORDINATOR, UID = 2, 1, "attacked-job"


def _pods(root: Path, key: bytes, ports: list[int], metrics_ports: list[int]) -> list[Pod]:
    (root / "fleet.key").write_text(key.hex())
    (root / "fleet.key").chmod(0o600)         # load_key refuses a key others can read
    ids = write_identities(root, WORLD, UID)
    target = {"nodes": WORLD, "parallelism": {"data": 1, "pipeline": 2, "microbatches": 2},
              "checkpoint": {"claimName": "run"}}
    drafter = {"activation": {"safetyMarginMs": 1}, "exchange": {"combineEverySeconds": 1}}
    return [Pod(root / f"pod-{r}", drafter=drafter, target=target,
                settings={"checkpoint_every_s": 1.0, "verify_every_s": 1.0, "samples_per_step": 4},
                env={"RANK": str(r), "WORLD_SIZE": str(WORLD), "SPECTRAIN_DRAFTER_PEERS":
                     ",".join(f"127.0.0.1:{p}" for p in ports), "SPECTRAIN_DRAFTER_BIND": "127.0.0.1",
                     ENV_FLEET_KEY_FILE: str(root / "fleet.key"), ENV_JOB_UID: UID, ENV_RESTART_GENERATION: "0",
                     ENV_METRICS_PORT: str(metrics_ports[r]), **ids[r]})
            for r in range(WORLD)]


def _rejected_metric(port: int) -> dict[str, float]:
    """spectrain_drafter_exchange_rejected_total by cause, scraped from a sidecar's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.labels["cause"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "spectrain_drafter_exchange_rejected_total"}


def _send(root: Path, port: int, key: bytes, rank: int, to: int,
          frames: list[tuple[str, dict[str, Any], bytes]]) -> None:
    """Frames to rank `to` as `rank`, with its pod's identity (read from its files, as its drafter
    does); a combined version signed with it."""
    ids = root / "identity" / str(rank)
    pod = PodIdentity(load_identity(ids / IDENTITY_ITEM), load_peers(ids / PEERS_ITEM, UID, 0))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        session = client_handshake(s, Identity(key, UID, 0, pod), rank, to)
        for kind, header, payload in frames:
            if kind == "combined":
                header = {**header, "signature": pod.sign(version_digest(UID, 0, header["version"], payload)).hex()}
            head, tag = session.seal(kind, json.dumps(header).encode(), payload)
            s.sendall(head + payload + tag)


def _sample(tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[str, dict[str, Any], bytes]:
    return ("sample", {"rank": 1, "step": 0, "shapes": [list(tokens.shape), list(hidden.shape)],
                       "dtypes": ["int64", "float32"]}, tokens.numpy().tobytes() + hidden.numpy().tobytes())


def _export(pod: Pod) -> torch.nn.Module | None:
    """The coordinator's exported drafter (the forged weights copy its tensor table), once there is one."""
    try:
        return load_drafter(pod.run_dir / "drafter")[0]
    except ConfigError:
        return None


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_sidecars_under_attack_stay_up_and_export_finite(tmp_path: Path) -> None:
    key, free = os.urandom(32), free_ports(2 * WORLD)
    ports, metrics_ports = free[:WORLD], free[WORLD:]
    pods = _pods(tmp_path, key, ports, metrics_ports)
    targets = _targets(pods)
    for pod in pods:
        pod.start_drafter()
    try:
        _drive(targets, pods, lambda: _summary(pods[COORDINATOR], COORDINATOR).get("combinedVersion", 0) >= 1
               and _summary(pods[0], 0).get("samplesFromPeers", 0) > 0 and _export(pods[COORDINATOR]) is not None,
               "a first round, an export and samples at rank 0")
        model = _export(pods[COORDINATOR])
        assert model is not None
        own = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        T, H, V = 64, TARGET_CFG.dim, TARGET_CFG.vocab_size
        nan = _sample(torch.arange(T) % V, torch.full((T, H), float("nan")))
        far = _sample(torch.arange(T) + V, torch.randn(T, H))
        huge = pack_params({n: p * 1e6 for n, p in own.items()})
        base = {"included": {"0": 1}, "work_s": 1.0}
        _send(tmp_path, ports[0], key, 1, 0, [nan] * 40 + [far] * 10 + [
            ("combined", {**base, "version": 1 << 62}, huge),
        ] + [  # some within the few versions ahead a member takes (its summary lags): refused on apply, for the norm
            ("combined", {**base, "version": _summary(pods[0], 0).get("combinedVersion", 0) + k}, huge)
            for k in range(1, 9)])
        # the coordinator: rank 0's real drafter is stopped meanwhile (SIGSTOP, a stalled peer), so
        # the forged contributions are the only ones of "rank 0" its rounds see
        pods[0].proc.send_signal(signal.SIGSTOP)                  # type: ignore[union-attr]
        try:
            coord = pods[COORDINATOR]
            contrib = {"rank": 0, "seq": 1, "samples_total": 1, "incarnation": "forged"}

            def refused(cause: str) -> int:
                return int(_summary(coord, COORDINATOR).get("exchangeRejectedByCause", {}).get(cause, 0))
            _send(tmp_path, ports[COORDINATOR], key, 0, COORDINATOR, [
                ("contrib", {**contrib, "work_total_s": 1.0}, huge),
                ("contrib", {**contrib, "work_total_s": 1.0}, pack_params({"other": torch.zeros(2)}))])
            _drive(targets, pods[1:], lambda: refused("update_norm") >= 1 and refused("keys") >= 1,
                   "the huge and the foreign contribution refused")
            work0 = _summary(coord, COORDINATOR)["exportWorkSecondsByRank"].get("0", 0.0)
            _send(tmp_path, ports[COORDINATOR], key, 0, COORDINATOR, [("contrib", {**contrib, "work_total_s": 1e30},
                                                               pack_params(own))])
            _drive(targets, pods[1:], lambda: _summary(coord, COORDINATOR)["exportWorkSecondsByRank"].get("0", 0.0)
                   > work0, "the forged work in a round")
            # credited at most at the rate of wall time since the forger's handshake (+ a round's slack)
            assert _summary(coord, COORDINATOR)["exportWorkSecondsByRank"]["0"] - work0 < 30
        finally:
            pods[0].proc.send_signal(signal.SIGCONT)              # type: ignore[union-attr]
        at = _summary(coord, COORDINATOR)["combinedVersion"]

        def refused_and_going_on() -> bool:
            s0, s1 = _summary(pods[0], 0), _summary(pods[COORDINATOR], COORDINATOR)
            c0 = s0.get("exchangeRejectedByCause", {})
            return (c0.get("nonfinite", 0) >= 40 and c0.get("token", 0) >= 10 and c0.get("version", 0) >= 1
                    and c0.get("update_norm", 0) >= 1 and s1.get("combinedVersion", 0) >= at + 2
                    and s0.get("combinedVersion", 0) > at and s1["exportWorkSecondsByRank"].get("0", 0) > 0)
        _drive(targets, pods, refused_and_going_on, "rank 0's refusals counted, two more rounds with both")
        # what a platform team's Prometheus sees (its summary is the same figures, a moment later)
        _drive(targets, pods, lambda: _rejected_metric(metrics_ports[0]).get("nonfinite", 0) >= 40,
               "the refusals on rank 0's Prometheus endpoint")
        assert _rejected_metric(metrics_ports[0]).get("token", 0) >= 10
    finally:
        for pod in pods:
            if pod.proc is not None and pod.proc.poll() is None:
                assert pod.stop_drafter(signal.SIGTERM, timeout=60) == 0
            pod.kill()
        for t in targets:
            t.close()
    model, meta = load_drafter(pods[COORDINATOR].run_dir / "drafter")
    assert _finite(model), meta
