"""bench-identity: what the per-pod identities cost, against a ServiceAccount token's verification.

sign_us / verify_us        Ed25519 (OpenSSL through `cryptography`), 64-byte signatures of a handshake
                           transcript (~170 bytes)
x25519_us                  one ephemeral X25519 key pair and its shared secret (one side of a handshake)
handshake_cpu_us_on/_off   a whole drafter handshake (drafter.auth: both ends, in one process over a
                           socketpair, CPU time) with the identities and the job's key, and without
                           them (the MAC-less bench mode): per connection, not per frame
listener_per_hello_us      what a hello costs the listener before the connecting side proves the job's
                           key (its ephemeral key, its tag and its signature): the price of a hello from
                           an outsider, which never makes the listener verify a signature
rs256_jwt_verify_us        verifying a projected ServiceAccount token (RS256, RSA-2048; split,
                           base64url-decode, JSON-parse, verify, check exp and aud): what each peer
                           would pay per handshake with tokens instead; a token is a bearer credential
                           (shown to one peer it can be replayed to another), so it cannot bind a
                           channel the way a signature over the handshake's transcript does
version_sign_ms_per_mib    signing a combined version (sha256 of its payload + one signature), per MiB,
version_verify_ms_per_mib  and verifying it, per MiB; the debug Eagle drafter's payload for scale

Run: python -m bench.identity [--quick]   (make bench-identity [QUICK=1])
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.common import parse_args, print_table, write_results
from spectrain_workloads.drafter import auth
from spectrain_workloads.drafter.auth import Identity, ServerHandshake, client_handshake
from spectrain_workloads.drafter.identity import (
    Ephemeral,
    PodIdentity,
    handshake_message,
    mint_local,
    version_digest,
)


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    """CPU microseconds per call of `fn` (this process, every thread), the median of 5 batches of n."""
    out = []
    for _ in range(5):
        c0 = time.process_time()
        for _ in range(n):
            fn()
        out.append((time.process_time() - c0) / n * 1e6)
    return sorted(out)[2]


def _handshake(client: Identity, server: Identity) -> None:
    a, b = socket.socketpair()

    def listen() -> None:
        hs = ServerHandshake(server, 1, 2)
        while hs.session is None:
            b.sendall(hs.feed(b.recv(hs.want)))
    t = threading.Thread(target=listen)
    t.start()
    client_handshake(a, client, 0, 1)
    t.join()
    a.close()
    b.close()


def _jwt() -> tuple[str, Any]:
    """A projected ServiceAccount token as the API server issues it, and its issuer's public key."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def b64(d: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d, separators=(",", ":")).encode()).rstrip(b"=").decode()
    now = int(time.time())
    claims = {"aud": ["spectrain-fleet"], "exp": now + 3600, "iat": now, "nbf": now,
              "iss": "https://kubernetes.default.svc.cluster.local", "sub": "system:serviceaccount:ns:job-drafter",
              "kubernetes.io": {"namespace": "ns", "pod": {"name": "job-3", "uid": os.urandom(16).hex()},
                                "serviceaccount": {"name": "job-drafter", "uid": os.urandom(16).hex()}}}
    signing_input = f"{b64({'alg': 'RS256', 'kid': os.urandom(20).hex()})}.{b64(claims)}"
    sig = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return signing_input + "." + base64.urlsafe_b64encode(sig).rstrip(b"=").decode(), key.public_key()


def _verify_jwt(token: str, public: Any) -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    def unb64(s: str) -> bytes:
        return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
    head, body, sig = token.split(".")
    if json.loads(unb64(head))["alg"] != "RS256":
        raise ValueError("alg")
    public.verify(unb64(sig), f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())
    claims = json.loads(unb64(body))
    if claims["exp"] < time.time() or "spectrain-fleet" not in claims["aud"]:
        raise ValueError("claims")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n = 200 if args.quick else 2000
    private, peers = mint_local("bench", 0, 1, 2)
    pods = [PodIdentity(p, peers) for p in private]
    key = os.urandom(32)
    msg = handshake_message(b"C", os.urandom(85), os.urandom(85))
    sig = pods[0].sign(msg)
    on = [Identity(key, "bench", 0, p) for p in pods]
    off = Identity(None, "bench", 0)
    token, issuer = _jwt()
    _, fresh = auth._fresh(on[0])
    hello = auth._hello(on[0], 0, fresh)           # a connecting side's hello (whoever sends it)

    def listener_hello() -> None:
        hs = ServerHandshake(on[1], 1, 2)
        hs.feed(hello[:hs.want])
        hs.feed(hello[len(hello) - hs.want:])

    mib = os.urandom(1 << 20)
    from spectrain_api.config import model_config
    from spectrain_workloads.drafter.fleet_records import pack_params
    from spectrain_workloads.drafter.models import EagleDrafter

    drafter = EagleDrafter(model_config("debug", {"n_layers": 4}, vocab_size=264))
    payload_mib = len(pack_params({k: p.detach() for k, p in drafter.named_parameters() if p.requires_grad})) / (1 << 20)
    keys = {
        "sign_us": per_call_us(lambda: pods[0].sign(msg), n),
        "verify_us": per_call_us(lambda: pods[1].verify(0, sig, msg), n),
        "x25519_us": per_call_us(lambda: Ephemeral().shared(Ephemeral().public), n // 2) / 2,
        "handshake_cpu_us_on": per_call_us(lambda: _handshake(on[0], on[1]), n // 10),
        "handshake_cpu_us_off": per_call_us(lambda: _handshake(off, off), n // 10),
        "listener_per_hello_us": per_call_us(listener_hello, n),
        "rs256_jwt_verify_us": per_call_us(lambda: _verify_jwt(token, issuer), n),
        "version_sign_ms_per_mib": per_call_us(lambda: pods[1].sign(version_digest("bench", 0, 1, mib)), n // 10) / 1e3,
        "version_verify_ms_per_mib": per_call_us(
            lambda: pods[0].verify(1, sig, version_digest("bench", 0, 1, mib)), n // 10) / 1e3,
        "debug_drafter_payload_mib": payload_mib,
    }
    print_table("bench-identity (per-pod Ed25519 identities vs a ServiceAccount token)", keys)
    write_results("identity", keys, args.quick)


if __name__ == "__main__":
    main()
