"""A drafter's fleet side under attack: one real Fleet + Replicas (drafter.fleet, drafter.replicas)
over a small model, in a process of its own, for tests/integration/test_fleet_attacks.py.

    python -m tests.integration.fleet_victim CONFIG_JSON

CONFIG_JSON: rank, ports, key (hex), job_uid, identity (its pod's private key, hex), peers (peers.json's
text), status (path), and optionally nofile (RLIMIT_NOFILE)
and spare_fds (descriptors left free after filling the table, once a member's link to the coordinator
(its hello) is up and holds its own: the accept loop then runs out).
Every STATUS_EVERY_S it takes what arrived exactly as the worker does (samples, combined versions
through Replicas.round) and writes its status: the Replicas summary, what it took and whether all
of it was finite and in range, the model's finiteness, its peak RSS. SIGTERM ends it.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from spectrain_api.fleet_identity import parse_peers
from spectrain_workloads.drafter.checks import TargetSpec
from spectrain_workloads.drafter.fleet import Fleet
from spectrain_workloads.drafter.fleet_records import FleetConfig
from spectrain_workloads.drafter.identity import PodIdentity
from spectrain_workloads.drafter.replicas import Replicas

WORLD, PIPELINE, COORDINATOR = 2, 2, 1
TARGET = TargetSpec(vocab=100, hidden=8, max_tokens=64)
STATUS_EVERY_S = 0.05


def model() -> torch.nn.Module:
    torch.manual_seed(0)                  # every rank's drafter starts from the same weights
    return torch.nn.Linear(8, 4)


def _peak_rss_bytes() -> int:
    """The process's peak resident memory (no descriptor needed: the rlimit test runs out of them)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fill_descriptors(spare: int) -> list[int]:
    """Open /dev/null until the table is full, then free `spare` descriptors."""
    held: list[int] = []
    try:
        while len(held) < 1 << 16:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for _ in range(spare):
        os.close(held.pop())
    return held


def main(cfg: dict[str, Any]) -> None:
    if cfg.get("nofile"):
        resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"]))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    fleet = Fleet(FleetConfig(rank=cfg["rank"], world=WORLD, pipeline=PIPELINE, coordinator=COORDINATOR,
                              addresses=[("127.0.0.1", p) for p in cfg["ports"]], key=bytes.fromhex(cfg["key"]),
                              pod=PodIdentity(bytes.fromhex(cfg["identity"]), parse_peers(cfg["peers"], "peers")),
                              job_uid=cfg["job_uid"], combine_every_s=0.2, target=TARGET))
    m = model()
    replicas = Replicas(fleet, cfg["rank"], log=lambda *a, **k: None)
    replicas.start(m, 0, 0)
    if "spare_fds" in cfg and cfg["rank"] != COORDINATOR:      # a fixed count: the hello's link holds its socket
        while fleet.links[COORDINATOR].sock is None and not stop.wait(0.01):
            pass
    held = _fill_descriptors(cfg["spare_fds"]) if "spare_fds" in cfg else []
    taken, bad, status = 0, 0, Path(cfg["status"])
    while not stop.wait(STATUS_EVERY_S):
        for tokens, hidden, _step, _src in fleet.take_samples(64):
            taken += 1
            ok = int(tokens.min()) >= 0 and int(tokens.max()) < TARGET.vocab
            bad += not (ok and (hidden is None or bool(torch.isfinite(hidden).all())))
        with torch.no_grad():
            m.weight.add_(1e-3)           # local progress, as training makes
        replicas.work_ns += 10_000_000
        replicas.round(taken, replicas.version + 1)
        finite = all(bool(torch.isfinite(p).all()) for p in m.parameters())
        latest = fleet.latest
        doc = {**replicas.summary(), "samplesTaken": taken, "samplesBad": bad, "modelFinite": finite,
               "rss": _peak_rss_bytes(), "held": len(held), "pid": os.getpid(),
               "latestWorkByRank": {str(r): w for r, w in latest.work_by_rank.items()} if latest else {},
               "latestFinite": latest is None or all(bool(torch.isfinite(p).all()) for p in latest.params.values())}
        try:
            tmp = status.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, status)
        except OSError:
            pass                          # out of descriptors for a moment (the rlimit test): next time
    fleet.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
