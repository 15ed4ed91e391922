"""Errors shared by the operator and the workloads. Messages name the field and the fix."""


class ConfigError(ValueError):
    """A configuration value cannot run; the message names the field path and how to fix it."""


class PeerFrameError(RuntimeError):
    """What a peer drafter sent made this drafter fail (fleet code raises it; the sidecar exits with
    names.EXIT_PEER_FRAME so the operator counts it apart from the drafter's own faults)."""
