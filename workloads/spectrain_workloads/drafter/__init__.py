"""The drafter sidecar: trains a speculative-decoding drafter inside the target's idle windows.

Modules (one concept each):
- settings:  validated drafter settings (SpecTrainJob spec.drafter + presets)
- models:    EagleDrafter (contracts.md Eagle convention), the LM drafter, losses, target weights
- gating:    when to work: the online unit-of-work estimate, window tracking, the gate
- combiner:  what to run: sample buffer, micro-batch planning, gradient accumulation
- verify:    acceptance against the target on fresh data
- export:    atomic versioned checkpoints, the deployable export, `load_drafter`
- metrics:   activity log, harvest accounting, the summary behind status.drafter
- worker:    the per-rank loop that ties them to the ring
- sidecar:   the `spectrain-drafter` console script

Only `export.load_drafter` is needed by consumers of a trained drafter.
"""
