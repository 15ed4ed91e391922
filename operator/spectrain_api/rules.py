"""The semantic rules of a SpecTrainJob, defined once: `check_spec(cfg)` returns every reason the
workloads would refuse a job at start, one line each (the field path, what is wrong, what to change).

The operator's `spectrain validate` and reconcile call it (spectrain_operator.spec), and every
workload entrypoint calls `require_valid` before any training. Needs neither torch nor a cluster.
"""

from __future__ import annotations

from typing import Any

from spectrain_api import eagle3, rundir, volumes
from spectrain_api.config import JobConfig, preset_model_config
from spectrain_api.errors import ConfigError
from spectrain_api.names import (
    ACTIVATION_POLICIES,
    ASYNC_PIPELINE,
    BASIS_GEOMETRIES,
    BASIS_SOURCES,
    DATA_BUILTINS,
    DEFAULT_PRESET,
    DRAFT_STRATEGIES,
    DRAFTER_ARCHS,
    DRAFTER_PRESETS,
    EAGLE,
    EAGLE3,
    EXCHANGE_ENGINES,
    GPIPE,
    INTERLEAVED,
    INTERLEAVED_CHUNKS,
    MAX_DRAFT_TOKENS,
    MAX_MIN_ACCEPTANCE,
    MODES,
    ONE_F_ONE_B,
    OPTIMIZERS,
    PRETRAIN,
    RL,
    RL_TASKS,
    SCHEDULES,
    WINDOW_KINDS,
)


def _one_of(path: str, value: Any, allowed: tuple[str, ...] | dict[str, Any]) -> list[str]:
    return [] if value in allowed else [f"{path}: {value!r} is not one of: {', '.join(allowed)}"]


def check_spec(cfg: JobConfig) -> list[str]:
    """Every reason the workloads would refuse this job at start, one line each: the field path,
    what is wrong and what to change. [] when it can run. Needs neither torch nor a cluster."""
    t, d = cfg.target, cfg.drafter
    par = t.parallelism
    out = _one_of("spec.mode", cfg.mode, MODES)
    out += _one_of("spec.target.parallelism.schedule", par.schedule, SCHEDULES)
    out += _one_of("spec.target.optimizer.name", t.optimizer.name, OPTIMIZERS)
    out += _one_of("spec.target.optimizer.basisRotation.geometry", t.optimizer.basis_rotation.geometry,
                   BASIS_GEOMETRIES)
    out += _one_of("spec.target.optimizer.basisRotation.source", t.optimizer.basis_rotation.source, BASIS_SOURCES)
    out += _one_of("spec.drafter.arch", d.arch, DRAFTER_ARCHS)
    out += _eagle3_field_errors(cfg)
    out += _one_of("spec.drafter.preset", d.preset, DRAFTER_PRESETS)
    out += _one_of("spec.drafter.activation.policy", d.activation.policy, ACTIVATION_POLICIES)
    out += _kinds_errors(list(d.activation.kinds))
    if not d.exchange.bandwidth_m_bps > 0:
        out.append(f"spec.drafter.exchange.bandwidthMBps: must be > 0 (MB/s a drafter may send to its peers), got "
                   f"{d.exchange.bandwidth_m_bps}; to keep the drafters apart set spec.drafter.exchange.enabled: false")
    out += _one_of("spec.drafter.exchange.engine", d.exchange.engine, EXCHANGE_ENGINES)
    if not d.exchange.combine_every_seconds >= 1:
        out.append(f"spec.drafter.exchange.combineEverySeconds: must be >= 1, got {d.exchange.combine_every_seconds}")
    out += rundir.export_path_errors(d.export.claim_name, d.export.path)
    out += min_acceptance_errors(d.export.min_acceptance)
    out += shared_volume_errors(cfg)
    out += _data_source_errors(t.data.source)
    if par.data < 1 or par.pipeline < 1 or par.microbatches < 1:
        return out + [f"spec.target.parallelism: data ({par.data}), pipeline ({par.pipeline}) and microbatches "
                      f"({par.microbatches}) must all be >= 1"]
    if par.data * par.pipeline != cfg.world_size:
        out.append(f"spec.target.parallelism: data ({par.data}) x pipeline ({par.pipeline}) = "
                   f"{par.data * par.pipeline} must equal nodes x procsPerNode = {cfg.world_size}")
    out += _mode_errors(cfg)
    if t.model.path is not None:   # its layer count is known where the directory is mounted (hf.source)
        if cfg.mode == ASYNC_PIPELINE:
            out.append("spec.target.model.path: mode AsyncPipeline trains the project's presets only; a Hugging "
                       "Face model trains in mode Pretrain or RL (use spec.target.model.preset for this mode)")
        return out + model_path_errors(t.model) + pipeline_errors(cfg, None)
    try:
        mcfg = preset_model_config(t.model)
    except ConfigError as exc:
        return out + [str(exc)]
    except TypeError as exc:        # a wrong value type inside overrides
        return out + [f"spec.target.model.overrides: {exc}"]
    out += pipeline_errors(cfg, mcfg.n_layers)
    out += eagle3_target_errors(cfg, mcfg.n_layers, mcfg.vocab_size)
    if t.data.seq_len > mcfg.max_seq_len:
        out.append(f"spec.target.data.seqLen: {t.data.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len} "
                   f"(preset {t.model.preset or DEFAULT_PRESET}); lower seqLen or set "
                   "spec.target.model.overrides.max_seq_len")
    return out


def min_acceptance_errors(value: Any) -> list[str]:
    """spec.drafter.export.minAcceptance: a number in [0, MAX_MIN_ACCEPTANCE] (the drafter's settings
    check the same value with this rule)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_MIN_ACCEPTANCE
    if ok:
        return []
    return [f"spec.drafter.export.minAcceptance: {value!r} is not a number in [0, {MAX_MIN_ACCEPTANCE:g}]; set the "
            "acceptance length (tokens per verification, e.g. 2.5) below which no export becomes LATEST, or 0 "
            "for no floor"]


def shared_volume_errors(cfg: JobConfig) -> list[str]:
    """Every drafter reads the target's embedding (written by pipeline stage 0), LM head and model
    config (the last stage) from the run volume's target/shared/. Without
    spec.target.checkpoint.claimName that volume is an emptyDir, private to each pod, so a pod that
    holds neither stage 0 nor the last one never gets them: its drafter would wait for the whole run
    and train nothing. Such a job is refused: one shared claim, or whole pipelines inside a pod."""
    t, par = cfg.target, cfg.target.parallelism
    P, procs = par.pipeline, t.procs_per_node
    if not cfg.drafter.enabled or t.checkpoint.claim_name or P <= 1 or procs < 1 or t.nodes <= 1:
        return []
    # Global rank r runs stage r % P (topology.py); pod n holds ranks [n procs, (n + 1) procs).
    # The stage pattern repeats every P pods, so P pods tell for all.
    lacking = [n for n in range(min(t.nodes, P))
               if not {0, P - 1} <= {r % P for r in range(n * procs, (n + 1) * procs)}]
    if not lacking:
        return []
    return [f"spec.target.checkpoint.claimName: required while the drafter is enabled and the pipeline's stages "
            f"span pods (pipeline {P} over {t.nodes} pods of {procs} process(es)): every drafter reads the "
            f"target's embedding (stage 0) and LM head (stage {P - 1}) from the run volume, which without a claim "
            f"is an emptyDir of each pod, so the drafter of pod {lacking[0]} would never get them and train "
            f"nothing. Set spec.target.checkpoint.claimName to a ReadWriteMany PersistentVolumeClaim that every "
            f"pod mounts, or keep each pipeline inside one pod (procsPerNode a multiple of {P}), or set "
            f"spec.drafter.enabled: false"]


def _eagle3_field_errors(cfg: JobConfig) -> list[str]:
    """The EAGLE-3 fields against the arch and the mode (the target's shape: eagle3_target_errors)."""
    d = cfg.drafter
    out: list[str] = []
    if d.arch != EAGLE3:
        for key, value in (("featureLayers", d.feature_layers), ("draftVocabSize", d.draft_vocab_size)):
            if value is not None:
                out.append(f"spec.drafter.{key}: only spec.drafter.arch: {EAGLE3} reads it (arch is {d.arch}); "
                           f"remove it or set arch {EAGLE3}")
    try:
        eagle3.check_ttt_steps(d.ttt_steps)
    except ConfigError as exc:
        out.append(str(exc))
    if d.arch == EAGLE3 and cfg.mode in (RL, ASYNC_PIPELINE):
        out.append(f"spec.drafter.arch: {EAGLE3} trains in mode {PRETRAIN} (its stages publish the feature "
                   f"layers); mode {RL}'s rollout engine and {ASYNC_PIPELINE} publish the final hidden state only: "
                   f"use arch {EAGLE}")
    if d.arch == EAGLE3 and cfg.mode == PRETRAIN and cfg.target.parallelism.schedule == INTERLEAVED:
        out.append(f"spec.target.parallelism.schedule: arch {EAGLE3} does not train under {INTERLEAVED} (a rank "
                   "runs several model chunks and another microbatch's forward can come between them, so its "
                   f"feature layers cannot be matched per microbatch); use schedule {ONE_F_ONE_B} or {GPIPE}, "
                   f"or arch {EAGLE}")
    return out


def eagle3_target_errors(cfg: JobConfig, n_layers: int | None, vocab_size: int | None) -> list[str]:
    """spec.drafter.featureLayers / draftVocabSize of an arch Eagle3 drafter against the target's layer
    count and vocabulary, each when known (a preset here; a Hugging Face target where its config.json
    is read: the workloads call the same spectrain_api.eagle3 rules). [] for any other arch."""
    d = cfg.drafter
    if d.arch != EAGLE3:
        return []
    out: list[str] = []
    if n_layers is not None:
        try:
            layers = eagle3.feature_layers(d, n_layers)
        except ConfigError as exc:
            out.append(str(exc))
        else:
            P = cfg.target.parallelism.pipeline
            away = sorted(s for s in eagle3.feature_stages(layers, n_layers, P) if s != P - 1) if P >= 1 else []
            if away and not d.exchange.enabled:
                out.append(f"spec.drafter.exchange.enabled: false, but feature layers {list(layers)} lie on pipeline "
                           f"stage(s) {away}, whose parts reach the last stage's drafter only over the exchange; "
                           f"enable it, choose featureLayers on the last stage, or use arch {EAGLE}")
    if vocab_size is not None:
        try:
            eagle3.resolve_draft_vocab_size(d.draft_vocab_size, vocab_size)
        except ConfigError as exc:
            out.append(str(exc))
    return out


def model_path_errors(model: Any) -> list[str]:
    """The rules of `spec.target.model.path` that need no file system (the operator checks them too);
    the directory itself is checked where it is mounted (hf.source.inspect)."""
    path, field = model.path, "spec.target.model.path"
    out: list[str] = []
    if model.preset is not None:
        out.append(f"spec.target.model: preset ({model.preset!r}) and path are exclusive; remove preset to "
                   "train the model at path, or path to train the preset")
    if model.overrides:
        out.append(f"spec.target.model.overrides: not applied to a model given by path (its config.json "
                   f"decides its shape); remove overrides ({sorted(model.overrides)})")
    return out + volumes.errors(field, path)


def _kinds_errors(kinds: list[str]) -> list[str]:
    path = "spec.drafter.activation.kinds"
    if not kinds:
        return [f"{path}: empty; list at least one of {', '.join(WINDOW_KINDS)}"]
    bad = [k for k in kinds if k not in WINDOW_KINDS]
    if bad:
        return [f"{path}: unknown kinds {bad}; use {', '.join(WINDOW_KINDS)}"]
    if len(set(kinds)) != len(kinds):
        return [f"{path}: duplicates; list each kind once"]
    return []


def _data_source_errors(source: str) -> list[str]:
    path = "spec.target.data.source"
    if source.startswith(volumes.BUILTIN_SCHEME):
        name = source[len(volumes.BUILTIN_SCHEME):]
        return [] if name in DATA_BUILTINS else [
            f"{path}: {source!r} is not a builtin dataset; use one of "
            f"{', '.join(volumes.BUILTIN_SCHEME + b for b in DATA_BUILTINS)}, {volumes.FORMS}"]
    if not source.startswith((volumes.FILE_SCHEME, volumes.PVC_SCHEME)):
        return [f"{path}: {source!r}: use {volumes.BUILTIN_SCHEME}{DATA_BUILTINS[0]}, {volumes.FORMS}"]
    return volumes.errors(path, source)


def _mode_errors(cfg: JobConfig) -> list[str]:
    t, par = cfg.target, cfg.target.parallelism
    out: list[str] = []
    if (cfg.mode == RL) != (t.rl is not None):
        out.append("spec.target.rl: required when spec.mode is RL and forbidden otherwise")
    if cfg.mode == RL and par.pipeline != 1:
        out.append(f"spec.target.parallelism.pipeline: mode RL runs data-parallel only (rollouts need the whole "
                   f"model on each rank); set pipeline to 1 (got {par.pipeline})")
    if cfg.mode == RL and t.rl is not None:
        rl = t.rl
        out += _one_of("spec.target.rl.task", rl.task, RL_TASKS)
        out += _one_of("spec.target.rl.speculative.strategy", rl.speculative.strategy, DRAFT_STRATEGIES)
        if rl.group_size < 2:
            out.append(f"spec.target.rl.groupSize: must be >= 2 (GRPO advantages are group-relative), "
                       f"got {rl.group_size}")
        if not 1 <= rl.speculative.max_draft_tokens <= MAX_DRAFT_TOKENS:
            out.append(f"spec.target.rl.speculative.maxDraftTokens: must be in 1..{MAX_DRAFT_TOKENS}, "
                       f"got {rl.speculative.max_draft_tokens}")
        if rl.max_new_tokens < 1:
            out.append(f"spec.target.rl.maxNewTokens: must be >= 1, got {rl.max_new_tokens}")
        if rl.temperature < 0:
            out.append(f"spec.target.rl.temperature: must be >= 0 (0 is greedy), got {rl.temperature}")
    if cfg.mode == ASYNC_PIPELINE:
        if par.pipeline < 2:
            out.append(f"spec.target.parallelism.pipeline: mode AsyncPipeline needs >= 2 stages, got {par.pipeline}")
        if par.data != 1:
            out.append(f"spec.target.parallelism.data: mode AsyncPipeline runs one replica; set data to 1 "
                       f"(got {par.data})")
    if cfg.mode == PRETRAIN and t.data.batch_size % par.microbatches:
        out.append(f"spec.target.data.batchSize: {t.data.batch_size} must be a multiple of "
                   f"spec.target.parallelism.microbatches ({par.microbatches}); each microbatch takes "
                   "batchSize / microbatches sequences")
    return out


def pipeline_errors(cfg: JobConfig, n_layers: int | None) -> list[str]:
    """The pipeline rules; those about the layer count only when it is known (`n_layers`)."""
    par = cfg.target.parallelism
    model = cfg.target.model
    what = f"preset {model.preset or DEFAULT_PRESET}" if model.path is None else f"model at {model.path}"
    out: list[str] = []
    if par.pipeline > 1 and par.microbatches < par.pipeline and cfg.mode == PRETRAIN:
        out.append(f"spec.target.parallelism.microbatches: must be >= pipeline ({par.pipeline}) when "
                   f"pipeline > 1, got {par.microbatches}")
    if n_layers is not None and n_layers % par.pipeline:
        out.append(f"spec.target.parallelism.pipeline: {par.pipeline} stages do not divide the model's "
                   f"{n_layers} layers ({what}); choose a divisor of {n_layers}"
                   + (" or set spec.target.model.overrides.n_layers" if model.path is None else ""))
    if par.schedule == INTERLEAVED and cfg.mode == PRETRAIN:
        v = INTERLEAVED_CHUNKS
        if par.pipeline < 2:
            out.append("spec.target.parallelism.pipeline: Interleaved1F1B interleaves model chunks across "
                       "pipeline ranks and needs pipeline >= 2; use schedule 1F1B for pipeline 1")
        elif par.microbatches % par.pipeline:
            out.append(f"spec.target.parallelism.microbatches: Interleaved1F1B needs a multiple of pipeline "
                       f"({par.pipeline}), got {par.microbatches}")
        if n_layers is not None and n_layers % (v * par.pipeline):
            fix = (f"set spec.target.model.overrides.n_layers to a multiple of {v * par.pipeline}, lower pipeline, "
                   "or use schedule 1F1B") if model.path is None else "lower pipeline or use schedule 1F1B"
            out.append(f"spec.target.parallelism.schedule: Interleaved1F1B gives each of the {par.pipeline} "
                       f"pipeline ranks {v} model chunks, so {v} x pipeline = {v * par.pipeline} must divide the "
                       f"model's {n_layers} layers; {fix}")
    return out


def require_valid(cfg: JobConfig) -> None:
    """ConfigError with every problem of `cfg` (the entrypoints' first call)."""
    errors = check_spec(cfg)
    if errors:
        raise ConfigError("; ".join(errors))
