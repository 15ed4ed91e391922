"""The target side of a pod: the training job whose idle time is harvested.

- `entry`: the `spectrain-target` entrypoint (spawns local ranks, dispatches on spec.mode);
- `trainer`: the Pretrain loop (DP x PP), `pipeline` + `schedule` its stage executor and
  schedules (GPipe, 1F1B, Interleaved1F1B), `async_pipeline` the AsyncPipeline mode;
- `instrument`, `window_predictors`, `imbalance_watch`: the idle windows and their predictions;
- `publisher`: hidden states and tokens into the ring's data channel.
"""
