"""The target side of a pod: the training job whose idle time is harvested.

- `entry`: the `spectrain-target` entrypoint (spawns local ranks, dispatches on spec.mode);
- `trainer`: the Pretrain loop (DP x PP), `pipeline` its stage executor over the schedules of
  harvest/schedule.py (GPipe, 1F1B, Interleaved1F1B), `async_pipeline` the AsyncPipeline mode.

The idle windows, their predictions, the DDP comm hook and the data publisher are harvest/'s;
what a run trains (a preset or a Hugging Face directory) is target_model.py's.
"""
