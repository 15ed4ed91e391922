"""The harvest engine: the components every trainer uses to publish its idle windows and data.

The built-in trainer (target/) and the public hooks API for a user's trainer (hooks/) both sit
on these; nothing here imports target/, hooks/ or rl/ (tests/unit/project/test_import_graph.py).

- `instrument`: Bubble / Communication / Imbalance windows of one rank: open, close, sync points,
  the ring records, once-per-step learning, cost accounting; `instrumented_step`, the
  on-off-off-on pattern of interleaved steps;
- `window_history`: a window and its metrics record; what `instrument` learns from closed windows
  (per bubble slot, per transfer) and the predictions it caches from that;
- `window_predictors`: the pure predictors `window_history` drives (no clocks, no state);
- `imbalance_watch`: the deadline that opens an Imbalance window while a rank is still blocked;
- `schedule`: pipeline schedules (GPipe, 1F1B, Interleaved1F1B) as per-stage action lists with
  their idle slots, and the simulation that predicts each slot's length;
- `data_publisher`: the last stage's hidden states [b, T, H] and tokens [b, T] into the ring;
- `comm_hook`: the DDP comm hook, torch's bucket all-reduce with a Communication window.
"""
