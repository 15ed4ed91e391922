"""The drafter sidecar: trains a speculative-decoding drafter inside the target's idle windows.

Modules (one concept each):
- settings:  validated drafter settings (SpecTrainJob spec.drafter + presets)
- models:    EagleDrafter (contracts.md Eagle convention), the LM drafter, losses, target weights
- hf_eagle:  the EAGLE-1 drafter of a Hugging Face target; serving_export: its vLLM / SGLang layouts
- eagle3:    the EAGLE-3 drafter (3 target layers fused, draft vocabulary, TTT loss);
             eagle3_export, eagle3_tables: its sglang/ and speculators/ layouts and their loaders' tables
- gating:    when to work: the online unit-of-work estimate, window tracking, the gate
- combiner:  what to run: sample buffer, micro-batch planning, gradient accumulation
- verify:    acceptance against the target on fresh data
- export:    atomic versioned checkpoints, the deployable export, `load_drafter`
- metrics:   activity log, harvest accounting, the summary behind status.drafter
- worker:    the per-rank loop that ties them to the ring; its parts: worker_intake (reading the
             ring), worker_tasks (task costs, work in windows), worker_export (checkpoints, the
             export gate), worker_reporting (state, summary, back channel)
- fleet, fleet_weights, fleet_records, links, listener, auth, checks: the drafters' authenticated
             exchange of samples and weights (engine Star); allreduce, ring_replicas: engine AllReduce
- control:   the operator's control file (disabled in place)
- sidecar:   the `spectrain-drafter` console script

Only `export.load_drafter` is needed by consumers of a trained drafter.
"""
