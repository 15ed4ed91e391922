"""The harvest engine: the components every trainer uses to publish its idle windows and data.

The built-in trainer (target/) and the public hooks API for a user's trainer (hooks/) both sit
on these; nothing here imports target/, hooks/ or rl/ (tests/unit/test_import_graph.py).

- `instrument`: Bubble / Communication / Imbalance windows of one rank, their predictions, the
  ring and metrics records; `instrumented_step`, the on-off-off-on pattern of interleaved steps;
- `window_predictors`: the pure predictors `instrument` drives (no clocks, no state);
- `imbalance_watch`: the deadline that opens an Imbalance window while a rank is still blocked;
- `schedule`: pipeline schedules (GPipe, 1F1B, Interleaved1F1B) as per-stage action lists with
  their idle slots, and the simulation that predicts each slot's length;
- `data_publisher`: the last stage's hidden states [b, T, H] and tokens [b, T] into the ring;
- `comm_hook`: the DDP comm hook, torch's bucket all-reduce with a Communication window.
"""
