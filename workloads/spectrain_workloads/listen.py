"""Where a pod's listeners bind: the pod's own address, never every interface.

The target's rendezvous store, the drafters' AllReduce store and the Prometheus endpoints listen on
ENV_POD_IP (the operator sets it from the downward API's status.podIP; `spectrain run` sets
127.0.0.1), so in a local run nothing of the job is reachable from another host, and in a cluster
nothing listens on an address the NetworkPolicy does not cover (a hostNetwork pod, a second
interface). The drafters' exchange binds ENV_POD_IPS itself (drafter.sidecar: every family).

torch's TCPStore has no bind address (its server listens on `::` / 0.0.0.0): `serve_store` binds
the socket here and hands it over (`master_listen_fd`), so the store listens where we say.

Torch is imported only by `serve_store` and `client_store`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_POD_IP

LOOPBACK = "127.0.0.1"
BACKLOG = 1024           # torch's own listener's backlog order: every rank of a large job connects at once


def pod_address(default: str = LOOPBACK) -> str:
    """The address this pod's listeners bind: ENV_POD_IP, else `default` (loopback: a process
    started outside the operator and `spectrain run` reaches nothing it did not ask for)."""
    host = os.environ.get(ENV_POD_IP, "").strip() or default
    require_specific(host, ENV_POD_IP)
    return host


def require_specific(host: str, what: str) -> None:
    """Refuse a wildcard address (every interface): the listeners bind one address of the pod."""
    try:
        wildcard = host == "" or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = False             # a host name: resolved by bound_socket
    if wildcard:
        raise ConfigError(f"{what}={host!r} is every interface; set the pod's own address "
                          f"(the operator sets {ENV_POD_IP} from status.podIP; `spectrain run` uses {LOOPBACK})")


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host` (an address or a name, resolved to its first address) and
    `port` (0: any free port). SO_REUSEADDR as torch's own listener sets it, so a restarted store
    takes its port back while the old connections sit in TIME_WAIT."""
    require_specific(host, "listen address")
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(BACKLOG)
    except OSError:
        s.close()
        raise
    return s


def serve_store(host: str, port: int, *, timeout: timedelta, world_size: int | None = None) -> Any:
    """A c10d TCPStore served by this process on `host:port` only (`.port` is the bound port). The
    store owns the socket from here on (closing it with the store)."""
    import torch.distributed as dist

    s = bound_socket(host, port)
    bound = int(s.getsockname()[1])
    return dist.TCPStore(host, bound, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=s.detach())


def client_store(host: str, port: int, *, timeout: timedelta, world_size: int | None = None) -> Any:
    """A client of the TCPStore another process serves at `host:port`."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, is_master=False, wait_for_workers=False, timeout=timeout)


def rendezvous_store(rank: int, world: int, timeout: timedelta) -> Any:
    """The target's c10d store, as init_process_group's env:// makes it (rank 0 serves it at
    MASTER_ADDR:MASTER_PORT, the others connect; keys under "default_pg"), except that rank 0's
    server listens on the pod's address only: ENV_POD_IP, else MASTER_ADDR itself."""
    import torch.distributed as dist

    master = os.environ.get("MASTER_ADDR", "").strip()
    raw_port = os.environ.get("MASTER_PORT", "").strip()
    if not master or not raw_port.isdigit():
        raise ConfigError(f"MASTER_ADDR={master!r} / MASTER_PORT={raw_port!r}: WORLD_SIZE={world} needs both "
                          "(the operator sets them; rank 0 serves the rendezvous there)")
    port = int(raw_port)
    if rank == 0:
        store = serve_store(pod_address(default=master), port, timeout=timeout, world_size=world)
    else:
        store = client_store(master, port, timeout=timeout, world_size=world)
    return dist.PrefixStore("default_pg", store)


__all__ = ["LOOPBACK", "bound_socket", "client_store", "pod_address", "rendezvous_store", "require_specific",
           "serve_store"]
