"""listen: the stores and the metrics endpoints listen on the pod's address only. Loopback is all of
127.0.0.0/8 on Linux, so a listener on 127.0.0.1 alone refuses a connection to 127.0.0.2 (one on
every interface would take it): that is how each test sees what was bound."""

from __future__ import annotations

import socket
import urllib.request
from datetime import timedelta

import pytest
from prometheus_client import CollectorRegistry

from spectrain_api.errors import ConfigError
from spectrain_api.names import ENV_POD_IP
from spectrain_workloads import listen
from spectrain_workloads.drafter.allreduce import start_store
from spectrain_workloads.metrics_endpoint import Endpoint
from tests.launch import free_ports

T = timedelta(seconds=10)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


def test_pod_address_is_the_pod_ip_else_loopback_and_never_a_wildcard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_POD_IP, raising=False)
    assert listen.pod_address() == "127.0.0.1"
    monkeypatch.setenv(ENV_POD_IP, "10.1.2.3")
    assert listen.pod_address() == "10.1.2.3"
    for wildcard in ("0.0.0.0", "::"):
        monkeypatch.setenv(ENV_POD_IP, wildcard)
        with pytest.raises(ConfigError, match=f"{ENV_POD_IP}='{wildcard}' is every interface.*status.podIP"):
            listen.pod_address()


def test_a_served_store_listens_on_its_address_only() -> None:
    store = listen.serve_store("127.0.0.1", 0, timeout=T, world_size=2)
    client = listen.client_store("127.0.0.1", store.port, timeout=T)
    store.set("k", "v")
    assert client.get("k") == b"v"
    assert not _reachable("127.0.0.2", store.port)
    with pytest.raises(ConfigError, match="every interface"):
        listen.serve_store("0.0.0.0", 0, timeout=T)


def test_the_allreduce_store_listens_on_its_address_only() -> None:
    store = start_store("127.0.0.1", 0)
    assert _reachable("127.0.0.1", store.port) and not _reachable("127.0.0.2", store.port)


def test_the_target_rendezvous_store_binds_the_pod_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_ports(1)[0]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv(ENV_POD_IP, "127.0.0.1")
    served = listen.rendezvous_store(0, 2, T)
    joined = listen.rendezvous_store(1, 2, T)
    served.set("x", "1")
    assert joined.get("x") == b"1"
    assert not _reachable("127.0.0.2", port)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        listen.rendezvous_store(1, 2, T)


def test_a_metrics_endpoint_listens_on_the_pod_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_POD_IP, "127.0.0.1")
    ep = Endpoint(CollectorRegistry(), free_ports(1)[0])
    try:
        assert urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/metrics", timeout=10).status == 200
        assert not _reachable("127.0.0.2", ep.port)
    finally:
        ep.stop()
