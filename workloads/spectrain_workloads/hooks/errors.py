"""The one error type of the hooks API: wrong use that the caller can fix (named in the message)."""

from __future__ import annotations


class HookError(ValueError):
    """A hooks call that cannot work as made: an unknown schedule type, tensors of mismatched
    shapes, a window kind the job did not enable, a torch without the internals an adapter needs."""
