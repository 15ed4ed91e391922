"""The drafter fleet's configuration and the records it exchanges (drafter.fleet uses them):
who is where (`parse_peers`), what a combined version and a contribution hold, and how tensors
become frame payloads (safetensors for weights; raw bytes for samples, bf16 as an int16 view).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_DRAFTER_PEERS, ENV_DRAFTER_STORE
from spectrain_workloads.drafter import checks
from spectrain_workloads.drafter.admission import RTT_BOUND_S, Limits
from spectrain_workloads.drafter.identity import PodIdentity

# engine AllReduce: the drafters' TCPStore as host:port (tests, local runs); default `store_address`


def parse_peers(text: str, world: int, local_world: int) -> list[tuple[str, int]]:
    """Address of every rank from `host:port` per node (local rank i listens on port + i); IPv6
    hosts in brackets, `[fd00::1]:29600`."""
    nodes = [p.strip() for p in text.split(",") if p.strip()]
    if len(nodes) * local_world != world:
        raise ConfigError(f"{ENV_DRAFTER_PEERS} lists {len(nodes)} nodes x {local_world} local ranks, but WORLD_SIZE is "
                          f"{world}: one host:port per node (the operator sets it)")
    out = []
    for n in nodes:
        host, _, port = n.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{ENV_DRAFTER_PEERS}: {n!r} is not host:port")
        out += [(host.removeprefix("[").removesuffix("]"), int(port) + i) for i in range(local_world)]
    return out


def store_address(addresses: list[tuple[str, int]], export_rank: int, local_world: int) -> tuple[str, int]:
    """Where the exporting rank's drafter hosts the drafters' TCPStore (engine AllReduce): its pod's
    host, at the port after that pod's drafter ports (base + LOCAL_WORLD_SIZE), so one store per job
    and never a port a drafter of any pod listens on."""
    host, port = addresses[export_rank]
    return host, port - export_rank % local_world + local_world


def parse_store(text: str) -> tuple[str, int]:
    """ENV_DRAFTER_STORE's `host:port` (IPv6 hosts in brackets)."""
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{ENV_DRAFTER_STORE}: {text!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


@dataclass
class Combined:
    version: int
    params: dict[str, torch.Tensor]
    included: dict[int, int]           # rank -> sequence number of the contribution averaged in
    work_s: float                      # window work in this version, over every contribution
    work_by_rank: dict[int, float] = field(default_factory=dict)   # coordinator only: each rank's part
    samples_by_rank: dict[int, int] = field(default_factory=dict)  # coordinator only: the samples of that work


@dataclass
class Contribution:
    seq: int
    params: dict[str, torch.Tensor]
    work_total_s: float               # the sender's window work since it started (cumulative)
    incarnation: str = ""             # the sender process: a restarted drafter counts from 0 again
    samples_total: int = 0            # the samples that work trained on (cumulative)
    received_at: float = 0.0          # (monotonic) when it arrived
    session_started: float = 0.0      # when the connection it came on authenticated


@dataclass
class Credit:
    """Coordinator: what of one rank's process (incarnation) is already in a combined version."""

    incarnation: str
    work_s: float
    samples: int
    at: float                         # when the contribution credited last arrived


@dataclass
class FleetConfig:
    rank: int
    world: int
    pipeline: int
    coordinator: int
    addresses: list[tuple[str, int]]
    key: bytes                        # the job's key (auth.load_key); 32 bytes
    pod: PodIdentity | None = None    # this pod's identity (needed unless `trust` is False)
    job_uid: str = ""
    generation: int = 0
    bind_hosts: list[str] = field(default_factory=lambda: ["127.0.0.1"])   # the pod's IPs (sidecar._fleet)
    bandwidth_bytes_per_s: float = 64e6
    combine_every_s: float = 10.0
    max_queue_bytes: int = 8 << 20
    inbox_bytes: int = 64 << 20
    sample_ranks: list[int] = field(default_factory=list)      # where this rank's samples go
    sample_sources: list[int] = field(default_factory=list)    # whose samples this rank takes
    rtt_bound_s: float = RTT_BOUND_S  # declared round trip (drafter.admission: the handshake's deadlines)
    target: checks.TargetSpec | None = None                      # default: read from run_dir at `expect`
    run_dir: str | None = None
    # False: no MACs, identities, signed versions, nor checks of received samples' values and weights:
    # bench-fleet's measure of their cost only (a separate protocol: never talks to a trusting drafter)
    trust: bool = True
    engine: str = "Star"              # names.EXCHANGE_ENGINES: AllReduce sends no weights through the star
    store: tuple[str, int] | None = None   # AllReduce: the drafters' TCPStore (`store_address`)

    @property
    def assembler(self) -> int:
        """The rank assembling this replica's EAGLE-3 samples: its last stage's."""
        return self.rank - self.rank % self.pipeline + self.pipeline - 1

    def __post_init__(self) -> None:
        P = self.pipeline
        if not self.sample_ranks and self.rank % P == P - 1:
            base = self.rank - P + 1
            self.sample_ranks = [base + s for s in range(P - 1)]
        if not self.sample_sources and self.rank % P != P - 1:
            self.sample_sources = [self.rank - self.rank % P + P - 1]
        if not self.rtt_bound_s > 0:
            raise ConfigError(f"FleetConfig.rtt_bound_s must be > 0 seconds, got {self.rtt_bound_s}")

    @property
    def limits(self) -> Limits:
        """What a listener of this job admits (drafter.admission's formulas)."""
        return Limits.for_job(world=self.world, ranks_per_host=Limits.ranks_per_host(self.addresses),
                              combine_every_s=self.combine_every_s, rtt_bound_s=self.rtt_bound_s)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a CPU tensor (bf16 through an int16 view: numpy has no bfloat16)."""
    t = t.detach().to("cpu")
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def pack_params(params: dict[str, torch.Tensor]) -> bytes:
    return st_save({n: p.detach().to("cpu").contiguous() for n, p in params.items()})


def unpack_params(data: bytes) -> dict[str, torch.Tensor]:
    return dict(st_load(data))


__all__ = ["Combined", "Contribution", "Credit", "FleetConfig", "pack_params",
           "parse_peers", "parse_store", "raw_bytes", "store_address", "unpack_params"]
