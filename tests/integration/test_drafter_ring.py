"""Four drafter sidecars as one fleet with spec.drafter.exchange.engine AllReduce (pipeline 2 x data 2),
each a real process next to a synthetic target of its own, as in test_drafter_fleet.

Checked: the samples still go through the fleet, the weights only through the ring (no star weight
frame sent by anyone); every rank applies combined versions and the ranks that trained have work in
them; a SIGKILLed drafter blocks nobody (the survivors, a majority, make more versions) and,
restarted, rejoins at the fleet's newest version; the export loads, finite.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from spectrain_api.names import ENV_DRAFTER_STORE, ENV_FLEET_KEY_FILE, ENV_JOB_UID, ENV_RESTART_GENERATION
from spectrain_workloads.drafter.export import load_drafter
from spectrain_workloads.drafter.synthetic import SyntheticTarget
from tests.fleet_ids import write_identities
from tests.integration.drafter_procs import Pod
from tests.integration.test_drafter_fleet import _drive as fleet_drive
from tests.integration.test_drafter_fleet import _summary, _targets
from tests.launch import free_ports

pytestmark = pytest.mark.integration

WORLD, PIPELINE, EXPORTER, KILLED = 4, 2, 3, 0
TIMEOUT = 120


def _pods(root: Path) -> list[Pod]:
    ports = free_ports(WORLD + 1)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports[:WORLD])
    key = root / "fleet.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)                          # load_key refuses a key others can read
    ids = write_identities(root, WORLD, "ring-test-uid")   # each pod's identity Secret
    target = {"nodes": WORLD, "parallelism": {"data": 2, "pipeline": PIPELINE, "microbatches": 2},
              "checkpoint": {"claimName": "run"}}      # the processes share one run directory
    drafter = {"activation": {"safetyMarginMs": 1}, "exchange": {"combineEverySeconds": 1, "engine": "AllReduce"}}
    return [Pod(root / f"pod-{r}", drafter=drafter, target=target,
                settings={"checkpoint_every_s": 1.0, "verify_every_s": 1.0, "samples_per_step": 4},
                env={"RANK": str(r), "WORLD_SIZE": str(WORLD), "SPECTRAIN_DRAFTER_PEERS": peers,
                     "SPECTRAIN_DRAFTER_BIND": "127.0.0.1", ENV_DRAFTER_STORE: f"127.0.0.1:{ports[WORLD]}",
                     ENV_FLEET_KEY_FILE: str(key), ENV_JOB_UID: "ring-test-uid", ENV_RESTART_GENERATION: "0",
                     **ids[r]})
            for r in range(WORLD)]


def _drive(targets: list[SyntheticTarget], pods: list[Pod], until: Any, what: str) -> Any:
    return fleet_drive(targets, pods, until, what, timeout=TIMEOUT)


def test_four_drafters_combine_through_the_ring_and_survive_a_sigkill(tmp_path: Path) -> None:
    pods = _pods(tmp_path)
    targets = _targets(pods)
    for pod in pods:
        pod.start_drafter()
    try:
        def all_combined() -> bool:
            s = [_summary(p, r) for r, p in enumerate(pods)]
            return all(x.get("harvestedSeconds", 0) > 0 and x.get("combinedVersion", 0) >= 1
                       and x.get("combinedWorkSeconds", 0) > 0 for x in s)
        _drive(targets, pods, all_combined, "every drafter trained and has work in an applied ring version")
        s = [_summary(p, r) for r, p in enumerate(pods)]
        assert [x["fleetRole"] for x in s] == ["ring"] * WORLD
        for r in (0, 2):            # first stages: the last stages' samples, through the fleet
            assert s[r]["samplesFromPeers"] > 0 and s[r]["samplesTrained"] > 0
        assert all(x["weightFramesSent"] == 0 for x in s), [x["weightFramesSent"] for x in s]
        # (weights that came before a drafter's model existed are refused as not_ready: not the ring's)
        assert not any(c.startswith("allreduce") for x in s for c in x["exchangeRejectedByCause"]), s

        pods[KILLED].proc.send_signal(signal.SIGKILL)       # type: ignore[union-attr]
        pods[KILLED].proc.wait()                            # type: ignore[union-attr]
        pods[KILLED].proc = None
        at_kill = max(_summary(pods[r], r)["combinedVersion"] for r in range(WORLD) if r != KILLED)

        def goes_on() -> bool:
            return all(_summary(pods[r], r).get("combinedVersion", 0) >= at_kill + 2 for r in range(WORLD) if r != KILLED)
        _drive(targets, pods, goes_on, "two more versions on every survivor without the killed drafter")

        pods[KILLED].start_drafter()
        restarted_at = _summary(pods[EXPORTER], EXPORTER)["combinedVersion"]

        def rejoined() -> bool:
            setups = pods[KILLED].of_rank("setup", KILLED)
            if len(setups) < 2:
                return False
            events = pods[KILLED].events(KILLED)
            after = events[events.index(setups[1]):]
            return any(e["event"] == "combined" and e["version"] >= restarted_at for e in after)
        _drive(targets, pods, rejoined, "the restarted drafter's setup and the fleet's version applied after it")
        # and it is a member again: a round with its work in it
        _drive(targets, pods, lambda: any(e["event"] == "combined" and e["version"] > restarted_at
                                          and e["credited_s"] > 0 for e in pods[KILLED].of_rank("combined", KILLED)),
               "the restarted drafter's work in a version")
        assert _summary(pods[KILLED], KILLED).get("weightFramesSent", 0) == 0
    finally:
        live = {r: pod.proc for r, pod in enumerate(pods) if pod.proc is not None and pod.proc.poll() is None}
        for proc in live.values():          # all at once, as the pods of a job that ends
            proc.send_signal(signal.SIGTERM)
        codes = {r: proc.wait(timeout=60) for r, proc in live.items()}
        for pod in pods:
            pod.kill()
        for t in targets:
            t.close()
    # every drafter leaves the ring (its last round, its thread ended, not torn down) and exits 0
    assert codes == {r: 0 for r in range(WORLD)}, codes
    model, meta = load_drafter(pods[EXPORTER].run_dir / "drafter")
    assert meta["version"] >= 1
    assert all(bool(torch.isfinite(p).all()) for p in model.state_dict().values())
    versions = [e["version"] for e in pods[EXPORTER].of_rank("checkpoint", EXPORTER)]
    assert versions == sorted(versions) and meta["version"] <= versions[-1]
