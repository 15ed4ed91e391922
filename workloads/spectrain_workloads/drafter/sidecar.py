"""`spectrain-drafter`: the drafter native sidecar of one pod.

Environment (docs/contracts.md): SPECTRAIN_CONFIG, SPECTRAIN_RING_DIR, SPECTRAIN_RUN_DIR,
SPECTRAIN_EXPORT_DIR, SPECTRAIN_DRAFTER_ENABLED, SPECTRAIN_DEVICE, RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / CUDA_MPS_PINNED_DEVICE_MEM_LIMIT.
Drafter-only knobs (tests, benchmarks): SPECTRAIN_DRAFTER_SETTINGS (JSON overrides of
DrafterSettings), SPECTRAIN_DRAFTER_EXPORT_RANK (which rank exports; default WORLD_SIZE-1, a
last-stage rank under both rank orders), SPECTRAIN_DRAFTER_THREADS (CPU threads, default 1),
SPECTRAIN_DRAFTER_STORE (engine AllReduce: the drafters' store as host:port; default the exporting
rank's pod at its first drafter port + LOCAL_WORLD_SIZE).

One worker per local rank follows ring file `ring-<i>`: in this process for one local rank,
else in one spawned process each. A disabled drafter (SPECTRAIN_DRAFTER_ENABLED=0, drafter.enabled
false, policy Off) stays up idle, since a native sidecar that exits is restarted by the kubelet.
Disabled in place by the operator (the job's status.drafterDisabled, or the pod annotation
names.ANNOTATION_DRAFTER_DISABLED seen in the downward-API file SPECTRAIN_DRAFTER_CONTROL names; read
by drafter.control): checked before anything opens the ring, touches the device or builds a model,
and again while working; the worker then stops, releases its model and the ring, reports Disabled/DisabledByOperator
and idles until SIGTERM.
A failure caused by a peer's frame (errors.PeerFrameError) exits with names.EXIT_PEER_FRAME, which
the operator counts apart from the drafter's own faults.
SIGTERM: each worker finishes its current task (<= one micro-step), writes a checkpoint and
exits 0, well inside the default 30 s grace period. A fatal error exits with
spectrain_api.exitcodes' code (2 for a configuration error) and writes its line as the
container's termination message (`write_termination_message`); drafter faults never fail the job.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from spectrain_api.errors import ConfigError, PeerFrameError
from spectrain_api.names import (
    ANNOTATION_DRAFTER_DISABLED,
    ENV_DEVICE,
    ENV_DRAFTER_ENABLED,
    ENV_EXPORT_DIR,
    ENV_RING_DIR,
    ENV_RUN_DIR,
    EXIT_PEER_FRAME,
)
from spectrain_workloads import podstatus
from spectrain_workloads.drafter.control import CONTROL_EVERY_S, REASON_DISABLED, DrafterControl

_QTY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)
_POW = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_memory(value: str, device_index: int = 0) -> int | None:
    """Bytes from CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("8G", "8Gi", "0=8G,1=4G", "8589934592").

    K/M/G/T are binary with or without the `i` (MPS's reading); for a per-device list, the
    entry of `device_index` (None when absent).
    """
    text = value.strip()
    if not text:
        return None
    if "=" in text:
        entries = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        if str(device_index) not in entries:
            return None
        text = entries[str(device_index)]
    m = _QTY.match(text)
    if not m:
        raise ConfigError(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={value!r} is not a memory size; "
                          "use e.g. 8G, 8Gi or 0=8G (spec.drafter.gpuShare.pinnedMemoryLimit)")
    return int(float(m.group(1)) * 1024 ** _POW[m.group(2).upper()])


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _settings(cfg: Any) -> Any:
    from spectrain_workloads.drafter.settings import DrafterSettings

    raw = os.environ.get("SPECTRAIN_DRAFTER_SETTINGS", "")
    try:
        overrides = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"SPECTRAIN_DRAFTER_SETTINGS is not JSON ({exc})") from None
    return DrafterSettings.from_spec(cfg.drafter, seed=cfg.seed, **overrides)


def _device(local_rank: int) -> Any:
    import torch

    want = os.environ.get(ENV_DEVICE, "auto")
    if want not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"SPECTRAIN_DEVICE={want!r}: use auto, cpu or cuda")
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("SPECTRAIN_DEVICE=cuda but no CUDA device is visible to the drafter container")
    if want == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _memory_cap(device: Any) -> int | None:
    """Device memory cap in bytes; on CUDA also enforced by the caching allocator."""
    import torch

    if device.type != "cuda":
        return None
    raw = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
    cap = parse_memory(raw, device.index or 0) if raw else None
    if cap is None:
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(cap / total, 1e-3)), device)
    return min(cap, total)


def run_worker(local_rank: int, stop: Any = None) -> int:
    """Run the worker of one local rank until `stop` (a threading/multiprocessing Event) is set."""
    from spectrain_api import config
    from spectrain_api.rules import require_valid

    stop = stop or threading.Event()
    cfg = config.load()
    require_valid(cfg)
    settings = _settings(cfg)
    ring_dir = os.environ.get(ENV_RING_DIR)
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not ring_dir or not run_dir:
        raise ConfigError("SPECTRAIN_RING_DIR and SPECTRAIN_RUN_DIR must be set (the operator or `spectrain run` "
                          "sets them to the ring and checkpoint volumes)")
    rank = _env_int("RANK", 0) + local_rank
    prometheus, server = _prometheus(rank, local_rank)
    try:
        return _run_worker(cfg, settings, local_rank, rank, Path(run_dir), Path(ring_dir), stop, prometheus)
    finally:
        if server is not None:
            server.final()      # the last summary (the fleet's last round) reaches Prometheus
            server.stop()
        podstatus.drain()       # and the job's status (the final export's artifact)


def _prometheus(rank: int, local_rank: int) -> tuple[Any, Any]:
    """The drafter's Prometheus endpoint on SPECTRAIN_METRICS_PORT + local rank (0 or unset: none).
    A port that cannot be bound costs the metrics, never the drafter: said on stderr."""
    from spectrain_api.names import ENV_METRICS_PORT
    from spectrain_workloads.drafter.prometheus import DrafterCollector, serve

    base = _env_int(ENV_METRICS_PORT, 0)
    if base <= 0:
        return None, None
    collector = DrafterCollector(rank)
    try:
        return collector, serve(collector, base + local_rank)
    except OSError as exc:
        print(f"spectrain-drafter: rank {rank}: no Prometheus metrics: port {base + local_rank}: {exc}",
              file=sys.stderr, flush=True)
        return None, None


def _run_worker(cfg: Any, settings: Any, local_rank: int, rank: int, run_dir: Path, ring_dir: Path, stop: Any,
                prometheus: Any) -> int:
    import torch

    from spectrain_api.reports import export_rank as default_export_rank
    from spectrain_workloads.drafter.worker import Worker

    control = DrafterControl.from_env()
    if control.disabled():      # before the device, the ring, the fleet or a model
        return idle_disabled(run_dir, rank, settings, stop, prometheus)
    world = _env_int("WORLD_SIZE", 1)
    export_rank = _env_int("SPECTRAIN_DRAFTER_EXPORT_RANK", default_export_rank(world))   # the operator's too
    export_dir = Path(os.environ.get(ENV_EXPORT_DIR) or run_dir / cfg.drafter.export.path)
    device = _device(local_rank)
    if device.type == "cpu":
        torch.set_num_threads(_env_int("SPECTRAIN_DRAFTER_THREADS", 1))
    enabled = os.environ.get(ENV_DRAFTER_ENABLED, "1") != "0" and cfg.drafter.enabled
    if not enabled:
        settings.policy = "Off"
    fleet = _fleet(cfg, rank, world, export_rank, settings.policy)
    worker = Worker(settings=settings, rank=rank, ring_path=ring_dir / f"ring-{local_rank}",
                    run_dir=run_dir, export_dir=export_dir if rank == export_rank else None,
                    device=device, stop=stop, memory_cap_bytes=_memory_cap(device), fleet=fleet, control=control,
                    prometheus=prometheus)
    try:
        return worker.run()
    finally:
        if fleet is not None:
            fleet.close()


def idle_disabled(run_dir: Path, rank: int, settings: Any, stop: Any, prometheus: Any = None) -> int:
    """Disabled by the operator from the start: say so in the summary, then wait for SIGTERM (the ring
    stays closed, so the target's back channel keeps the last state an earlier incarnation wrote)."""
    from spectrain_workloads.drafter.metrics import write_summary

    print(f"spectrain-drafter: rank {rank} disabled by the operator (status.drafterDisabled or "
          f"{ANNOTATION_DRAFTER_DISABLED}); idle", flush=True)
    summary = {"state": "Disabled", "reason": REASON_DISABLED, "policy": settings.policy, "arch": settings.arch}
    write_summary(run_dir, rank, {**summary, "updatedAt": time.time()}, flush=True)
    if prometheus is not None:
        prometheus.update(summary)
    while not stop.wait(CONTROL_EVERY_S):
        pass
    return 0


def _fleet(cfg: Any, rank: int, world: int, export_rank: int, policy: str) -> Any:
    """The exchange with the job's other drafters (drafter.fleet); None where fleet_in_use says none.
    It listens on the pod's own addresses (ENV_POD_IPS, one socket per family; ENV_DRAFTER_BIND overrides,
    comma-separated), never on every interface, and authenticates with the job's key and its pod's own
    identity (ENV_FLEET_IDENTITY_FILE, and every pod's public key in ENV_FLEET_PEERS_FILE)."""
    from spectrain_api.fleet_identity import fleet_in_use, load_identity, load_peers
    from spectrain_api.names import (
        ALLREDUCE,
        ENV_DRAFTER_BIND,
        ENV_DRAFTER_PEERS,
        ENV_DRAFTER_STORE,
        ENV_FLEET_IDENTITY_FILE,
        ENV_FLEET_KEY_FILE,
        ENV_FLEET_PEERS_FILE,
        ENV_JOB_UID,
        ENV_POD_IPS,
        ENV_RESTART_GENERATION,
    )
    from spectrain_workloads.drafter.auth import load_key
    from spectrain_workloads.drafter.fleet import Fleet
    from spectrain_workloads.drafter.fleet_records import FleetConfig, parse_peers, parse_store, store_address
    from spectrain_workloads.drafter.identity import PodIdentity

    ex = cfg.drafter.exchange
    peers = os.environ.get(ENV_DRAFTER_PEERS, "")
    if not fleet_in_use(policy, ex.enabled, world) or not peers:
        return None
    binds = [h.strip() for h in (os.environ.get(ENV_DRAFTER_BIND) or os.environ.get(ENV_POD_IPS, "")).split(",") if h.strip()]
    if not binds:
        raise ConfigError(f"neither {ENV_DRAFTER_BIND} nor {ENV_POD_IPS} is set: the drafter exchange listens on the pod's "
                          f"own addresses only (the operator sets {ENV_POD_IPS} from status.podIPs)")
    local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    addresses = parse_peers(peers, world, local_world)
    store = None
    if ex.engine == ALLREDUCE:    # the weights through the ring, on the store the exporting rank's drafter hosts
        override = os.environ.get(ENV_DRAFTER_STORE, "")
        store = parse_store(override) if override else store_address(addresses, export_rank, local_world)
    job_uid, generation = os.environ.get(ENV_JOB_UID, ""), _env_int(ENV_RESTART_GENERATION, 0)
    key = load_key(os.environ.get(ENV_FLEET_KEY_FILE))
    pod = PodIdentity(load_identity(os.environ.get(ENV_FLEET_IDENTITY_FILE)),
                      load_peers(os.environ.get(ENV_FLEET_PEERS_FILE), job_uid, generation))
    if pod.peers.world != world:
        raise ConfigError(f"{ENV_FLEET_PEERS_FILE} lists {len(pod.peers.public_keys)} pods x "
                          f"{pod.peers.local_world} local ranks, but WORLD_SIZE is {world}: mount this job's "
                          "fleet-identity Secret of this restart generation")
    return Fleet(FleetConfig(
        rank=rank, world=world, pipeline=cfg.target.parallelism.pipeline, coordinator=export_rank,
        addresses=addresses, engine=ex.engine, store=store, key=key, pod=pod, job_uid=job_uid,
        generation=generation, bind_hosts=binds,
        bandwidth_bytes_per_s=ex.bandwidth_m_bps * 1e6, combine_every_s=ex.combine_every_seconds,
        run_dir=os.environ.get(ENV_RUN_DIR)))


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown: torch's native threads (gloo, the c10d store
    client) may still be alive, and destroying them at exit aborts the process (SIGABRT) instead
    of returning the drafter's exit code. Everything the drafter writes is closed or flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _child(local_rank: int, stop: Any) -> None:
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _exit(_guarded(lambda: run_worker(local_rank, stop)))


def _fail(exc: BaseException) -> int:
    """Log the fatal error, write it as the container's termination message, return the exit code."""
    from spectrain_api.exitcodes import exit_code_for, fatal_message, write_termination_message

    print(f"spectrain-drafter: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    write_termination_message(fatal_message(exc))
    return exit_code_for(exc)


def _guarded(fn: Any) -> int:
    try:
        return int(fn())
    except PeerFrameError as exc:     # a peer's frame, not this drafter: the operator counts it apart
        _fail(exc)
        return EXIT_PEER_FRAME
    except Exception as exc:  # the exit code tells the operator's failure policy what happened
        return _fail(exc)


def main(argv: list[str] | None = None) -> int:
    try:
        local_world = _env_int("LOCAL_WORLD_SIZE", 1)
    except ConfigError as exc:
        return _fail(exc)
    if local_world == 1:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        return _guarded(lambda: run_worker(0, stop))
    ctx = mp.get_context("spawn")
    mstop = ctx.Event()
    procs = [ctx.Process(target=_child, args=(i, mstop), name=f"drafter-{i}") for i in range(local_world)]
    for p in procs:
        p.start()
    signal.signal(signal.SIGTERM, lambda *_: mstop.set())
    signal.signal(signal.SIGINT, lambda *_: mstop.set())
    for p in procs:
        p.join()
    return max((p.exitcode or 0) if p.exitcode is None or p.exitcode >= 0 else 128 - p.exitcode for p in procs)


def entrypoint() -> None:
    """`spectrain-drafter`."""
    _exit(main())


if __name__ == "__main__":
    entrypoint()
