"""spectrain workloads: target trainer, drafter sidecar, shared-memory ring, speculative decoding, optimizers.

Submodules import torch lazily where they can; `spectrain_workloads.ring` never imports torch.
"""

__version__ = "0.1.0"
