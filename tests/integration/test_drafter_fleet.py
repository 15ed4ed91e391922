"""Four drafter sidecars as one fleet (pipeline 2 x data 2), each a real process next to a
synthetic target of its own (real rings, real loopback sockets, one run directory per pod as on a
cluster without a shared volume).

Ranks 1 and 3 are last stages: only their rings carry samples. Checked: the first stages' drafters
get those samples and train in their own windows; every replica is combined into the versions the
coordinator (rank 3, the exporting rank) exports; a SIGKILLed drafter blocks nobody (rounds go on
without it) and, restarted, rejoins from the newest combined version.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from spectrain_api.names import ENV_FLEET_KEY_FILE, ENV_JOB_UID, ENV_RESTART_GENERATION
from spectrain_workloads.drafter.export import load_drafter
from spectrain_workloads.drafter.synthetic import SyntheticSpec, SyntheticTarget, WindowSpec
from tests.integration.drafter_procs import Pod, synthetic_target
from tests.launch import free_ports
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

WORLD, PIPELINE, COORDINATOR = 4, 2, 3
TIMEOUT = 240


def _pods(root: Path) -> list[Pod]:
    peers = ",".join(f"127.0.0.1:{p}" for p in free_ports(WORLD))
    key = root / "fleet.key"                 # the job's key, as the operator's Secret mounts it
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)                          # load_key refuses a key others can read
    target = {"nodes": WORLD, "parallelism": {"data": 2, "pipeline": PIPELINE, "microbatches": 2},
              "checkpoint": {"claimName": "run"}}      # the processes share one run directory
    drafter = {"activation": {"safetyMarginMs": 1}, "exchange": {"combineEverySeconds": 1}}
    return [Pod(root / f"pod-{r}", drafter=drafter, target=target,
                settings={"checkpoint_every_s": 1.0, "verify_every_s": 1.0, "samples_per_step": 4},
                env={"RANK": str(r), "WORLD_SIZE": str(WORLD), "SPECTRAIN_DRAFTER_PEERS": peers,
                     "SPECTRAIN_DRAFTER_BIND": "127.0.0.1", ENV_FLEET_KEY_FILE: str(key),
                     ENV_JOB_UID: "fleet-test-uid", ENV_RESTART_GENERATION: "0"})
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
