"""The shared-memory ring between target (producer) and drafter (consumer): no torch import.

One ring per local rank, served by the target at a path on the shared ring volume as a sealed
memfd (docs/contracts.md "The ring"; format, hand-over and the memory-ordering argument:
docs/ring.md). Channels, each with a single writer:
windows (target -> drafter), data (target -> drafter), back (drafter -> target).
"""

from spectrain_workloads.ring.consumer import RingConsumer
from spectrain_workloads.ring.errors import PayloadTooLarge, ProducerDead, RingError, RingVersionError
from spectrain_workloads.ring.layout import LAYOUT_VERSION, RingLayout, ring_path, ring_path_from_env
from spectrain_workloads.ring.producer import RingProducer
from spectrain_workloads.ring.records import BackMessage, DataRecord, WindowEvent, WindowKind
from spectrain_workloads.ring.sync import FENCE_IMPL, FUTEX_AVAILABLE

__all__ = [
    "FENCE_IMPL", "FUTEX_AVAILABLE", "LAYOUT_VERSION", "BackMessage", "DataRecord", "PayloadTooLarge",
    "ProducerDead", "RingConsumer", "RingError", "RingLayout", "RingProducer", "RingVersionError",
    "WindowEvent", "WindowKind", "ring_path", "ring_path_from_env",
]
