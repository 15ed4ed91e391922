"""Errors of the ring. Every message names the file and what to do about it."""

from __future__ import annotations


class RingError(RuntimeError):
    """The ring file cannot be used: missing, truncated, foreign, unwritable, or misused."""


class RingVersionError(RingError):
    """The file was written by a spectrain with another layout version (both versions named)."""


class ProducerDead(RingError):
    """The producer's heartbeat is older than the allowed age: the target died or hung."""


class PayloadTooLarge(RingError, ValueError):
    """A data payload or back-channel message does not fit its slot; names the layout field to raise."""
