"""The SpecTrainJob CRD as a Python definition: `scripts/gen.py` writes it to
crds/spectrain.io_spectrainjobs.yaml (the committed artifact everything else reads: the operator,
`spectrain validate`, the chart, docs/api.md). Edit here, run `python scripts/gen.py`, commit both.

Helpers keep every field's description next to its type and bounds; API.md is the contract. The
enums come from `spectrain_api.names` and the defaults of every field the workloads read
from `spectrain_api.config`'s dataclasses (`workload_defaults`): a default written here too
must be the same, or generation fails.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, get_type_hints

from spectrain_api import config as W
from spectrain_api import eagle3 as E3
from spectrain_api import names as C
from spectrain_api import rundir
from spectrain_api.names import GROUP, KIND, PLURAL, VERSION
from spectrain_api.volumes import HUB_ID_HINT

# Longest child-name suffix the operator uses is "-config"/"-status" (7) and pods "-<node>" with
# node < 1024 (5); gang/DRA objects add up to "-<node>-gpu" (9). 63 - 11 leaves 52 characters.
MAX_NAME_LENGTH = 52
MAX_NODES = 1024
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
# A relative path whose segments are never "..", not absolute, no empty segments (RE2-compatible,
# so a 1.20 apiserver enforces it too; the CEL rule carries the message).
REL_PATH_SEGMENT = r"([^/.][^/]*|\.|\.[^./][^/]*|\.\.[^/]+)"
REL_PATH_PATTERN = rf"^{REL_PATH_SEGMENT}(/{REL_PATH_SEGMENT})*$"
CONDITION_TYPES = ["Created", "Queued", "Running", "Restarting", "Suspended", "Succeeded", "Failed",
                   "DrafterActive", "DrafterDegraded", "DrafterNeverTrained", "SpecInvalid", "CheckpointEphemeral",
                   "ReconcileError"]


def s(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **kw}


def i(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "integer", "description": desc, **kw}


def n(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "number", "description": desc, **kw}


def b(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "boolean", "description": desc, **kw}


def o(desc: str, props: dict[str, Any] | None = None, *, required: list[str] | None = None,
      rules: list[dict[str, str]] | None = None, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "description": desc, **kw}
    if props is not None:
        out["properties"] = props
    if required:
        out["required"] = required
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


def counts(desc: str, each: str, causes: tuple[str, ...]) -> dict[str, Any]:
    """An object of non-negative counts, one integer per cause (`each`: the count's description)."""
    return o(desc, {c: i(f"{each}: {c}.", minimum=0) for c in causes})


def a(desc: str, items: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "array", "description": desc, "items": items, **kw}


def rule(expr: str, message: str) -> dict[str, str]:
    return {"rule": expr, "message": message}


def quantity(desc: str, **kw: Any) -> dict[str, Any]:
    return {"description": desc, "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN, **kw}


def string_list(desc: str) -> dict[str, Any]:
    return a(desc, s("One item.", maxLength=4096), maxItems=256)


def env_list(desc: str) -> dict[str, Any]:
    return a(desc, o("A core/v1 EnvVar.", {
        "name": s("Name of the environment variable.", minLength=1, maxLength=256),
        "value": s("Literal value.", maxLength=32768),
        "valueFrom": o("Source of the value (core/v1 EnvVarSource: fieldRef, resourceFieldRef, "
                       "configMapKeyRef, secretKeyRef), passed through unchanged.",
                       **{"x-kubernetes-preserve-unknown-fields": True}),
    }, required=["name"]), maxItems=256)


def resources(desc: str) -> dict[str, Any]:
    qmap = {"type": "object", "additionalProperties": quantity("A quantity, e.g. 2, 500m, 8Gi.")}
    return o(desc, {
        "limits": {**qmap, "description": "Maximum amount of compute resources allowed, by resource name."},
        "requests": {**qmap, "description": "Minimum amount of compute resources required, by resource name."},
    })


# Pod Security: what a job may set. Running as root, privileged or with privilege escalation is offered
# nowhere: Pod Security "restricted" refuses each, and no gpuSharing mode needs any of them
# (docs/gpu-sharing.md). Each refusal is a CEL rule whose message names the field and the fix, so the API
# server, the operator (re-checking for servers without CEL) and `spectrain validate` say the same words.
NOT_ROOT_WHY = "Pod Security 'restricted' forbids it and no gpuSharing mode needs it (docs/gpu-sharing.md)"


def seccomp_profile(path: str) -> dict[str, Any]:
    return o("Seccomp profile (core/v1 SeccompProfile); Unconfined is not offered. Default: RuntimeDefault.", {
        "type": s("RuntimeDefault (the container runtime's filter) or Localhost (a profile on the node).",
                  enum=["RuntimeDefault", "Localhost"]),
        "localhostProfile": s("The profile's path under the kubelet's seccomp directory (type Localhost).",
                              minLength=1, maxLength=4096),
    }, required=["type"], rules=[rule("self.type != 'Localhost' || has(self.localhostProfile)",
                                      f"{path}.localhostProfile: required when type is Localhost; set the "
                                      "profile's path or use type RuntimeDefault")])


def identity_fields(path: str) -> dict[str, Any]:
    return {
        "runAsUser": i(f"UID the process runs as; default {C.IMAGE_UID} (the workload image's user). 0 is refused.",
                       minimum=0, maximum=2147483647),
        "runAsGroup": i(f"Primary GID of the process; default {C.IMAGE_GID}.", minimum=0, maximum=2147483647),
        "runAsNonRoot": b("The kubelet refuses to start a container whose user is root; default true, false is "
                          "refused."),
        "seccompProfile": seccomp_profile(f"{path}.seccompProfile"),
    }


def identity_rules(path: str) -> list[dict[str, str]]:
    return [
        rule("!has(self.runAsUser) || self.runAsUser != 0",
             f"{path}.runAsUser: 0 (root) is refused: {NOT_ROOT_WHY}; remove it (the image's user "
             f"{C.IMAGE_UID} is the default) or set another non-zero UID"),
        rule("!has(self.runAsNonRoot) || self.runAsNonRoot",
             f"{path}.runAsNonRoot: false is refused: {NOT_ROOT_WHY}; remove it"),
    ]


def pod_security_context() -> dict[str, Any]:
    path = "spec.podSecurityContext"
    return o("Overrides of the pods' core/v1 PodSecurityContext. The operator's defaults pass Pod Security "
             f"\"restricted\": runAsNonRoot, runAsUser/runAsGroup/fsGroup {C.IMAGE_UID}/{C.IMAGE_GID}/{C.IMAGE_GID} "
             "(the workload image's user), fsGroupChangePolicy OnRootMismatch, seccomp RuntimeDefault; a field "
             "set here replaces its default. Applies to pods created after a change.", {
        **identity_fields(path),
        "fsGroup": i("Group that owns the pod's volumes (the fleet key is readable through it); default "
                     f"{C.IMAGE_GID}.", minimum=0, maximum=2147483647),
        "fsGroupChangePolicy": s("OnRootMismatch (default: skip the recursive chown of a volume whose root "
                                 "already matches) or Always.", enum=["OnRootMismatch", "Always"]),
        "supplementalGroups": a("Extra GIDs of every container's first process.",
                                i("A GID.", minimum=0, maximum=2147483647), maxItems=64),
    }, rules=identity_rules(path))


def _effective_uid(container_sc: str) -> str:
    """CEL: the UID a container runs as: its securityContext's runAsUser, else the pod's, else the
    image's user (access.POD_SECURITY_DEFAULTS)."""
    pod = (f"(has(self.podSecurityContext) && has(self.podSecurityContext.runAsUser) ? "
           f"self.podSecurityContext.runAsUser : {C.IMAGE_UID})")
    return f"(has({container_sc}) && has({container_sc}.runAsUser) ? {container_sc}.runAsUser : {pod})"


def container_security_context(path: str) -> dict[str, Any]:
    return o("Overrides of the container's core/v1 SecurityContext, on top of the operator's defaults "
             "(allowPrivilegeEscalation false, capabilities drop ALL; user, group and seccomp from the pod). "
             "privileged, allowPrivilegeEscalation true, runAsNonRoot false and runAsUser 0 are refused.", {
        **identity_fields(path),
        "allowPrivilegeEscalation": b("Default false; true is refused."),
        "privileged": b("Refused when true (GPUs come from nvidia.com/gpu or DRA, never from privilege)."),
        "readOnlyRootFilesystem": b("Mount the image's root filesystem read-only; libraries that cache under "
                                    "$HOME (torch, Hugging Face) then need it pointed at a volume through env."),
        "capabilities": o("Linux capabilities; default drop ALL.", {
            "add": a("Capabilities to add: only NET_BIND_SERVICE (what \"restricted\" allows).",
                     s("A capability.", enum=["NET_BIND_SERVICE"]), maxItems=1),
            "drop": a("Capabilities to drop; default [ALL]. Anything short of ALL fails \"restricted\".",
                      s("A capability.", minLength=1, maxLength=64), maxItems=64),
        }),
    }, rules=identity_rules(path) + [
        rule("!has(self.privileged) || !self.privileged",
             f"{path}.privileged: true is refused: {NOT_ROOT_WHY}; remove it"),
        rule("!has(self.allowPrivilegeEscalation) || !self.allowPrivilegeEscalation",
             f"{path}.allowPrivilegeEscalation: true is refused: {NOT_ROOT_WHY}; remove it"),
    ])


def network_policy() -> dict[str, Any]:
    selector = o("Namespaces (a metav1.LabelSelector on their labels) whose pods may scrape the metrics ports; "
                 "{} (the default): every namespace, where Prometheus may run.", {
        "matchLabels": o("Labels a namespace must carry.", additionalProperties=s("A label value.", maxLength=63),
                         maxProperties=64),
        "matchExpressions": a("Requirements on a namespace's labels.", o("A requirement.", {
            "key": s("Label key.", minLength=1, maxLength=317),
            "operator": s("How the key's value is matched.", enum=["In", "NotIn", "Exists", "DoesNotExist"]),
            "values": a("Values for In and NotIn.", s("A label value.", maxLength=63), maxItems=64),
        }, required=["key", "operator"]), maxItems=32),
    }, default={})
    return o("The job's NetworkPolicy `<job>` (owned by the job, created with its other children): the job's "
             "pods accept connections from each other on every port (the c10d store, the drafter exchange, and "
             "the ports gloo and NCCL open at random for their peer links) and on the metrics ports (target's and "
             "drafter's, each + local rank) from the namespaces of metricsFrom; nothing else reaches them. Egress is not restricted. Needs a network "
             "plugin that enforces NetworkPolicy. Immutable once created.", {
        "enabled": b("Create the NetworkPolicy; false: the pods are reachable as the namespace's other "
                     "policies allow.", default=True),
        "metricsFrom": selector,
    }, default={}, rules=[rule("self == oldSelf", "spec.networkPolicy is immutable (the NetworkPolicy is created "
                                                  "once with the job); create a new SpecTrainJob instead")])


def spec_schema() -> dict[str, Any]:
    parallelism = o("How the target's ranks are arranged. data * pipeline must equal nodes * procsPerNode.", {
        "data": i("Data-parallel degree.", default=1, minimum=1, maximum=4096),
        "pipeline": i("Pipeline-parallel degree (stages). Must divide the model's layer count.",
                      default=1, minimum=1, maximum=1024),
        "microbatches": i("Microbatches per step; at least `pipeline` when pipeline > 1 (Interleaved1F1B: "
                          "a multiple of `pipeline`).", default=1, minimum=1, maximum=65536),
        "schedule": s("Pipeline schedule. GPipe (all forwards, then all backwards) and 1F1B (warm-up, then "
                      "one forward one backward) idle (p-1)/(m+p-1) of a step; Interleaved1F1B gives each "
                      "rank 2 model chunks (virtual stages; needs pipeline >= 2 and 2 * pipeline dividing "
                      "the layer count) and idles (p-1)/(2m+p-1).",
                      default="1F1B", enum=list(C.SCHEDULES)),
    }, default={})
    basis = o("Basis-rotation optimizer settings; read only when optimizer.name is BasisRotation.", {
        "refreshEvery": i("Steps between eigenbasis refreshes.", default=10, minimum=1, maximum=1000000),
        "stageAware": b("Refresh earlier (staler) pipeline stages more often.", default=True),
        "geometry": s("Rotate one side or both sides of each weight matrix.", default="Bilateral",
                      enum=list(C.BASIS_GEOMETRIES)),
        "source": s("Moment whose eigenbasis defines the rotation.", default="SecondMoment",
                    enum=list(C.BASIS_SOURCES)),
    }, default={})
    rl = o("Reinforcement-learning settings; required when mode is RL, forbidden otherwise.", {
        "task": s("Task with verifiable rewards the workloads ship.", default="arithmetic",
                  enum=list(C.RL_TASKS)),
        "groupSize": i("Rollouts per prompt (GRPO group).", default=8, minimum=2, maximum=4096),
        "maxNewTokens": i("Longest rollout, in tokens.", default=512, minimum=1, maximum=1048576),
        "temperature": n("Sampling temperature; 0 is greedy.", default=1.0, minimum=0, maximum=100),
        "speculative": o("Speculative decoding of rollouts with the drafter.", {
            "enabled": b("Use the drafter to speculate rollouts (lossless).", default=True),
            "maxDraftTokens": i("Most tokens drafted per verification.", default=8, minimum=1,
                                  maximum=C.MAX_DRAFT_TOKENS),
            "batchThreshold": i("Speculate only while the active batch is at most this.", default=32,
                                minimum=1, maximum=1048576),
            "strategy": s("How the draft length is chosen.", default="Bandit", enum=list(C.DRAFT_STRATEGIES)),
        }, default={}),
    })
    target = o("The training job whose idle time is harvested. Immutable once created.", {
        "image": s("Workload image of the target (and the default for the drafter).", minLength=1,
                   maxLength=1024),
        "command": string_list("Overrides the entrypoint (default `spectrain-target`)."),
        "args": string_list("Arguments for the entrypoint."),
        "env": env_list("Extra environment variables, appended after the operator's."),
        "resources": resources("Compute resources of the target container (core/v1 ResourceRequirements)."),
        "securityContext": container_security_context("spec.target.securityContext"),
        "nodes": i("Number of pods (one per node).", default=1, minimum=1, maximum=MAX_NODES),
        "procsPerNode": i("Ranks per pod.", default=1, minimum=1, maximum=64),
        "parallelism": parallelism,
        "model": o("The target model: a project preset, or a Hugging Face model directory (path); neither: "
                   f"preset {C.DEFAULT_PRESET}.", {
            "preset": s("Model preset.", enum=list(C.TARGET_PRESETS)),
            "path": s("A Hugging Face model directory (config.json, *.safetensors, tokenizer.json): "
                      "file:///abs/dir or pvc://<claim>/<path>. Architectures: "
                      + ", ".join(C.HF_ARCHITECTURES) + ". Nothing is downloaded at run time.",
                      minLength=1, maxLength=1024, **{"x-kubernetes-validations": [
                          rule("self.startsWith('file:///') || self.startsWith('pvc://')",
                               "spec.target.model.path must be file:///abs/dir or pvc://<claim>/<path>; "
                               + HUB_ID_HINT)]}),
            "overrides": o("Free-form model config overrides of a preset, preserved as given.",
                           **{"x-kubernetes-preserve-unknown-fields": True}),
        }, default={}, rules=[
            rule("!(has(self.preset) && has(self.path))",
                 "spec.target.model: preset and path are exclusive; remove one"),
            rule("!has(self.path) || !has(self.overrides)",
                 "spec.target.model.overrides: not applied to a model given by path; remove overrides")]),
        "data": o("Training data.", {
            "source": s("builtin:<name> | file:///abs/dir | pvc://<claim>/<path>.",
                        default="builtin:python-stdlib", maxLength=1024,
                        pattern=r"^(builtin:[a-z0-9][-a-z0-9_.]*|file:///.*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?)$"),
            "seqLen": i("Sequence length in tokens.", default=256, minimum=8, maximum=1048576),
            "batchSize": i("Global batch per data-parallel replica, in sequences.", default=8, minimum=1,
                           maximum=1048576),
        }, default={}),
        "optimizer": o("Target optimizer.", {
            "name": s("Optimizer.", default="AdamW", enum=list(C.OPTIMIZERS)),
            "lr": n("Learning rate (> 0).", default=0.0003, minimum=0, exclusiveMinimum=True, maximum=100),
            "basisRotation": basis,
        }, default={}),
        "steps": i("Training steps.", default=1000, minimum=1, maximum=1000000000),
        "checkpoint": o("Checkpointing of the target (and the drafter, into the same volume).", {
            "claimName": s("PVC for checkpoints; empty: an emptyDir, lost with the pod (condition "
                           "CheckpointEphemeral says so).", maxLength=253),
            "everySteps": i("Steps between checkpoints.", default=100, minimum=1, maximum=1000000000),
            "keep": i("Checkpoints kept.", default=3, minimum=1, maximum=1000),
        }, default={}),
        "rl": rl,
    }, required=["image"], rules=[
        rule("self.parallelism.data * self.parallelism.pipeline == self.nodes * self.procsPerNode",
             "spec.target.parallelism: data * pipeline must equal nodes * procsPerNode"),
        rule("self.parallelism.pipeline <= 1 || self.parallelism.microbatches >= self.parallelism.pipeline",
             "spec.target.parallelism.microbatches must be >= pipeline when pipeline > 1"),
        rule("self == oldSelf", "spec.target is immutable; create a new SpecTrainJob instead"),
    ])
    drafter = o("The speculative-decoding drafter trained in the target's idle windows. Immutable once created.", {
        "enabled": b("Run the drafter sidecar.", default=True),
        "image": s("Drafter image; empty: target.image.", maxLength=1024),
        "arch": s("Eagle: one decoder layer on the target's final hidden states (EAGLE-1); LM: a small "
                  "standalone LM; Eagle3: three target feature layers fused, one decoder layer, a draft "
                  "vocabulary (EAGLE-3; mode Pretrain only). Default: Eagle3 for a Hugging Face target "
                  "(spec.target.model.path) in mode Pretrain, Eagle for a preset (or mode RL).",
                  enum=list(C.DRAFTER_ARCHS)),
        "featureLayers": a(f"arch Eagle3 only: three target layers whose inputs (the residual stream) the "
                           f"drafter fuses, strictly increasing, each in [0, L) for a target of L layers; "
                           f"default (2, L//2, L-3), the last three for L < {E3.DEFAULT_LAYERS_MIN}.",
                           i("A target layer id (its input: transformers' hidden_states[id]).", minimum=0,
                             maximum=1048576), minItems=3, maxItems=3, **{"x-kubernetes-validations": [
                    rule("size(self) != 3 || (self[0] < self[1] && self[1] < self[2])",
                         "spec.drafter.featureLayers must be strictly increasing")]}),
        "draftVocabSize": i(f"arch Eagle3 only: draft vocabulary, the most frequent target tokens of the job's "
                            f"data; at most the target's vocab; default min({E3.DRAFT_VOCAB_DEFAULT}, vocab).",
                            minimum=1, maximum=16777216),
        "tttSteps": i(f"arch Eagle3: training-time-test unroll steps, {E3.TTT_STEPS_RANGE[0]}-"
                      f"{E3.TTT_STEPS_RANGE[1]}, default {E3.TTT_STEPS_DEFAULT}.",
                      minimum=E3.TTT_STEPS_RANGE[0], maximum=E3.TTT_STEPS_RANGE[1]),
        "preset": s("Training preset of the drafter (its size and batch settings).", default="debug",
                    enum=list(C.DRAFTER_PRESETS)),
        "activation": o("When the drafter may use the GPU.", {
            "policy": s("IdleOnly: only inside target idle windows; Always: continuously; Off: never.",
                        default="IdleOnly", enum=list(C.ACTIVATION_POLICIES)),
            "minWindowMs": n("Shortest window worth using, ms; 0: measured by the drafter itself.",
                             default=0, minimum=0, maximum=3600000),
            "safetyMarginMs": n("Time left unused at the end of a window, ms.", default=2, minimum=0,
                                maximum=3600000),
            "kinds": a("Idle-window kinds the drafter uses; non-empty, no duplicates.",
                       s("A window kind.", enum=list(C.WINDOW_KINDS)), default=list(C.WINDOW_KINDS),
                       minItems=1, maxItems=4, **{"x-kubernetes-list-type": "set",
                                                  "x-kubernetes-validations": [
                    rule("self.all(k, self.exists_one(j, j == k))",
                         "spec.drafter.activation.kinds must not contain duplicates")]}),
        }, default={}),
        "gpuShare": o("The drafter's share of the GPU under MPS.", {
            "activeThreadPercentage": i("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the drafter.", default=30,
                                        minimum=1, maximum=100),
            "pinnedMemoryLimit": quantity("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT of the drafter.", default="8Gi"),
        }, default={}),
        "optimizer": o("Drafter optimizer.", {
            "lr": n("Learning rate (> 0).", default=0.001, minimum=0, exclusiveMinimum=True, maximum=100),
        }, default={}),
        "export": o("Where the deployable drafter artifact goes.", {
            "claimName": s("PVC for the artifact; empty: the checkpoint volume.", maxLength=253),
            "path": s("Relative path inside the volume; no '..', not absolute. On the run volume (no "
                      "claimName) a directory of the drafter's own, which it mounts read-write (the rest "
                      f"of that volume it mounts read-only): not '.' nor {', '.join(rundir.TARGET_ENTRIES)}.",
                      default=rundir.DRAFTER_DIR,
                      minLength=1, maxLength=253, pattern=REL_PATH_PATTERN,
                      **{"x-kubernetes-validations": [
                          rule("!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
                               "spec.drafter.export.path must be relative and must not contain '..'")]}),
            "minAcceptance": n("Absolute floor of the export gate: a candidate whose acceptance length (tokens per "
                               "verification) on the held-back samples is below it never becomes LATEST, nor one "
                               "that could not be measured. 0: no floor (candidates must still measure at least "
                               "LATEST's acceptance on the same samples).", minimum=0,
                               maximum=C.MAX_MIN_ACCEPTANCE),
        }, default={}),
        "exchange": o("How the drafters of a job work as one: the last pipeline stage's drafters share the "
                      "samples they read with the other stages' drafters, and every drafter's replica is "
                      "averaged into the one exported model (docs/design.md, the drafter fleet).", {
            "enabled": b("Exchange samples and combine the replicas; false: each drafter trains alone and "
                         "only the exporting rank's work reaches the export."),
            "bandwidthMBps": n("Most megabytes per second a drafter sends to its peers (samples and weights); "
                               "past it samples are dropped, never queued without bound.",
                               minimum=0, exclusiveMinimum=True, maximum=100000),
            "combineEverySeconds": n("Seconds between two rounds of averaging the drafters' replicas.",
                                     minimum=1, maximum=86400),
            "engine": s("How the replicas' weights are combined. Star: every round each drafter sends its "
                        "weights to the exporting rank's drafter, which averages them and sends the result back; "
                        "authenticated (the job's key, every frame MAC'd, every item checked), and it moves N "
                        "models per round through that one drafter (fine for tens of ranks). AllReduce: a gloo "
                        "ring all-reduce on the drafters' own TCPStore (hosted by the exporting rank's drafter), "
                        "whose per-rank traffic does not grow with N (hundreds to thousands of ranks); gloo's "
                        "transport in the PyTorch wheels is not authenticated (no TLS transport built in), so use "
                        "it only where a NetworkPolicy keeps the drafter ports to the job's own pods. What a "
                        "member receives is still checked before it is applied.",
                        default="Star", enum=list(C.EXCHANGE_ENGINES)),
        }, default={}),
        "maxFailures": i("Drafter failures on one rank at which the drafter is disabled in place on every rank "
                         f"(condition DrafterDegraded; exits with code {C.EXIT_PEER_FRAME}, a peer's frame, not "
                         "counted); the target is never stopped or restarted for it.",
                         default=3, minimum=0, maximum=1000),
        "resources": resources("Compute resources of the drafter container."),
        "securityContext": container_security_context("spec.drafter.securityContext"),
    }, default={}, rules=[rule("self == oldSelf", "spec.drafter is immutable; create a new SpecTrainJob instead")])
    gpu = o("How target and drafter share GPUs.", {
        "mode": s("DRA (ResourceClaim with MPS sharing), PodLocalMPS (MPS daemon sidecar), SingleContainer "
                  "(one supervised container), None (CPU or no sharing).", default="None",
                  enum=["DRA", "PodLocalMPS", "SingleContainer", "None"]),
        "gpusPerNode": i("GPUs per pod; 0 iff mode is None, else equal to procsPerNode.", default=0,
                         minimum=0, maximum=64),
        "dra": o("DRA settings.", {
            "deviceClassName": s("DeviceClass of the GPUs.", default="gpu.nvidia.com", maxLength=253),
        }, default={}),
        "mps": o("PodLocalMPS settings.", {
            "image": s("MPS daemon image; empty: target.image.", maxLength=1024),
            "runAsUser": i("UID shared by all containers (MPS serves only clients of its own user); runAsUser "
                           "overrides must equal it. 0 is refused.", default=C.IMAGE_UID, minimum=0,
                           maximum=2147483647),
        }, default={}, rules=[rule("!has(self.runAsUser) || self.runAsUser != 0",
                                   f"spec.gpuSharing.mps.runAsUser: 0 (root) is refused: {NOT_ROOT_WHY}; use "
                                   f"{C.IMAGE_UID} (the default, the image's user) or another non-zero UID")]),
    }, default={"mode": "None", "gpusPerNode": 0}, rules=[rule("(self.mode == 'None') == (self.gpusPerNode == 0)",
                               "spec.gpuSharing.gpusPerNode must be 0 iff spec.gpuSharing.mode is None")])
    failure_rule = o("A failure-policy rule.", {
        "action": s("What to do when the rule matches.", enum=["FailJob", "RestartJob", "RestartJobIgnoreMax",
                                                               "RestartWithoutDrafter"]),
        "onExitCodes": o("Exit codes the rule matches.", {
            "container": s("Container whose exit code is matched.", default="target", enum=["target", "drafter"]),
            "operator": s("In: the code is one of values; NotIn: it is none of them.", default="In",
                          enum=["In", "NotIn"]),
            "values": a("Exit codes, 0..255.", i("An exit code.", minimum=0, maximum=255), minItems=1,
                        maxItems=255),
        }, required=["values"]),
    }, required=["action", "onExitCodes"])
    run_policy = o("Restart, deadline and cleanup policy.", {
        "maxRestarts": i("Whole-job restarts after a target failure.", default=3, minimum=0, maximum=10000),
        "backoffSeconds": i("Base of the exponential backoff between restarts.", default=10, minimum=0,
                            maximum=86400),
        "activeDeadlineSeconds": i("Fail the job after this many seconds running; null: never.", minimum=1,
                                   maximum=31536000, nullable=True),
        "ttlSecondsAfterFinished": i("Delete the job this long after it finished; null: never.", minimum=0,
                                     maximum=31536000, nullable=True),
        "failurePolicy": o("Rules on exit codes; first match wins; default RestartJob.", {
            "rules": a("Ordered rules.", failure_rule, default=[], maxItems=32),
        }, default={}),
    }, default={})
    scheduling = o("How the pods are scheduled.", {
        "schedulerName": s("Scheduler of the pods; empty: the cluster default.", maxLength=253),
        "priorityClassName": s("PriorityClass of the pods.", maxLength=253),
        "gang": o("Gang scheduling (all pods or none).", {
            "provider": s("PodGroup provider.", default="None", enum=["None", "SchedulerPlugins", "Volcano"]),
        }, default={}),
        "nodeSelector": o("Node labels the pods require.", default={},
                          additionalProperties=s("A label value.", maxLength=63)),
        "tolerations": a("core/v1 Tolerations of the pods.", o("A toleration.", {
            "key": s("Taint key; empty with operator Exists matches all.", maxLength=317),
            "operator": s("Exists or Equal.", enum=["Exists", "Equal"]),
            "value": s("Taint value for Equal.", maxLength=63),
            "effect": s("Taint effect; empty matches all.", enum=["NoSchedule", "PreferNoSchedule", "NoExecute", ""]),
            "tolerationSeconds": i("For NoExecute: how long the pod stays bound.", minimum=0),
        }), default=[], maxItems=64),
    }, default={})
    return o("Desired state of the SpecTrainJob.", {
        "suspend": b("true: no pods exist; flipping back resumes from the last checkpoint.", default=False),
        "mode": s("Training mode.", default="Pretrain", enum=list(C.MODES)),
        "seed": i("Random seed of the workloads.", default=0, minimum=0, maximum=2147483647),
        "target": target,
        "drafter": drafter,
        "gpuSharing": gpu,
        "ring": o("The shared-memory ring between target and drafter.", {
            "sizeLimit": quantity("Size limit of the memory-backed ring volume.", default="256Mi"),
        }, default={}),
        "runPolicy": run_policy,
        "scheduling": scheduling,
        "podSecurityContext": pod_security_context(),
        "networkPolicy": network_policy(),
    }, required=["target"], rules=[
        rule("(self.mode == 'RL') == has(self.target.rl)",
             "spec.target.rl is required when spec.mode is RL and forbidden otherwise"),
        rule("self.mode != 'AsyncPipeline' || self.target.parallelism.pipeline >= 2",
             "spec.target.parallelism.pipeline must be >= 2 when spec.mode is AsyncPipeline"),
        rule("self.gpuSharing.gpusPerNode == 0 || self.gpuSharing.gpusPerNode == self.target.procsPerNode",
             "spec.gpuSharing.gpusPerNode must equal spec.target.procsPerNode when > 0"),
        rule("self.gpuSharing.mode != 'PodLocalMPS' || ("
             "(!has(self.podSecurityContext) || !has(self.podSecurityContext.runAsUser) || self.podSecurityContext.runAsUser == self.gpuSharing.mps.runAsUser) && "
             "(!has(self.target.securityContext) || !has(self.target.securityContext.runAsUser) || self.target.securityContext.runAsUser == self.gpuSharing.mps.runAsUser) && "
             "(!has(self.drafter.securityContext) || !has(self.drafter.securityContext.runAsUser) || self.drafter.securityContext.runAsUser == self.gpuSharing.mps.runAsUser))",
             "spec.gpuSharing.mps.runAsUser: PodLocalMPS runs every container as this one UID (MPS serves only "
             "clients of its own user); make spec.podSecurityContext.runAsUser and spec.target/drafter."
             "securityContext.runAsUser equal to it, or remove them"),
        rule("!has(self.drafter.exchange) || !has(self.drafter.exchange.engine) || "
             "self.drafter.exchange.engine != 'AllReduce' || !has(self.networkPolicy) || "
             "!has(self.networkPolicy.enabled) || self.networkPolicy.enabled",
             "spec.drafter.exchange.engine: AllReduce needs spec.networkPolicy.enabled (the ring's gloo transport "
             "is not authenticated, only the job's NetworkPolicy keeps other pods off it); enable the policy or "
             "use engine Star"),
        rule("self.gpuSharing.mode != 'SingleContainer' || !has(self.drafter.securityContext)",
             "spec.drafter.securityContext: in gpuSharing mode SingleContainer the drafter runs inside the target "
             "container, under spec.target.securityContext; remove it"),
        # The target creates the ring and the shared weight files for its own user only (mode 0600):
        # a drafter sidecar under another UID can open neither and waits (NoRing) for the whole run.
        # SingleContainer has no sidecar, PodLocalMPS runs every container as mps.runAsUser; a target
        # as root is refused by its own rule (one error, not two).
        rule("self.gpuSharing.mode == 'SingleContainer' || self.gpuSharing.mode == 'PodLocalMPS' || "
             f"{_effective_uid('self.target.securityContext')} == 0 || "
             f"{_effective_uid('self.drafter.securityContext')} == {_effective_uid('self.target.securityContext')}",
             "spec.drafter.securityContext.runAsUser: the drafter must run as the target's UID (spec.target."
             "securityContext.runAsUser, else spec.podSecurityContext.runAsUser, else "
             f"{C.IMAGE_UID}): the target creates the ring and the shared weight files private to its user "
             "(mode 0600), so a drafter under another UID never attaches to them (state NoRing) and trains "
             "nothing; remove spec.drafter.securityContext.runAsUser, or set it equal to the target's UID"),
    ])


def status_schema() -> dict[str, Any]:
    cond = o("A metav1.Condition.", {
        "type": s("Condition type.", maxLength=316),
        "status": s("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": s("CamelCase reason.", maxLength=1024),
        "message": s("Human-readable detail.", maxLength=32768),
        "lastTransitionTime": s("When status last changed.", format="date-time"),
        "observedGeneration": i("Generation the condition was set for.", minimum=0),
    }, required=["type", "status"])
    return o("Observed state, written by the operator once per reconcile pass.", {
        "phase": s("Lifecycle phase.", enum=list(C.PHASES)),
        "observedGeneration": i("metadata.generation the operator last acted on.", minimum=0),
        "conditions": a("Conditions: " + ", ".join(CONDITION_TYPES) + ".", cond,
                        **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}),
        "ranks": o("Pod counts.", {
            "desired": i("Pods the job wants.", minimum=0),
            "ready": i("Pods whose Ready condition is True.", minimum=0),
            "running": i("Pods in phase Running.", minimum=0),
            "succeeded": i("Pods whose target exited 0.", minimum=0),
            "failed": i("Pods whose target failed.", minimum=0),
        }),
        "ready": s("ready/desired pods, for kubectl."),
        "restarts": i("Whole-job restarts so far (all causes).", minimum=0),
        "restartsTowardsMax": i("Restarts counted against runPolicy.maxRestarts.", minimum=0),
        "restartGeneration": i("Generation of the current pods (label spectrain.io/restart-generation).",
                               minimum=0),
        "restartAt": s("When the pending restart recreates the pods (backoff).", format="date-time",
                       nullable=True),
        "podsCreated": b("Pods of the current restart generation were created (a missing pod then "
                         "means someone deleted it)."),
        "fleetKeyUID": s("UID of the fleet-key Secret the operator created for this job, recorded before any "
                         "pod mounts it: the operator may not read Secrets, so a Secret of that name it finds "
                         "existing is accepted as the job's own only when this is set."),
        "fleetIdentityGenerations": a("Restart generations whose per-pod fleet identity Secrets "
                                      "(<job>-fleet-id-<generation>-<node>) the operator created, all of a "
                                      "generation's in one pass and before any of its pods, and has not deleted "
                                      "yet; the operator may not read or list Secrets, so this is its record of "
                                      "them (docs/operations.md, Per-pod identities).",
                                      i("A restart generation.", minimum=0), maxItems=1000),
        "drafterDisabled": b("The drafter was turned off: disabled in place (past drafter.maxFailures, or a "
                             "drafter failurePolicy rule; the sidecars of drafterDisabledGeneration read this "
                             f"and idle, pods created in it carry {C.ANNOTATION_DRAFTER_DISABLED}, the target "
                             "is untouched), or by a RestartWithoutDrafter restart. Pods of later restart "
                             "generations have no drafter."),
        "drafterDisabledGeneration": i("Restart generation whose pods had the drafter when it was disabled "
                                       "(they keep an idle sidecar); later generations are built without it.",
                                       minimum=0),
        "drafterFailures": i("Most drafter failures seen on one rank, peer-frame exits not included.", minimum=0),
        "drafterPeerFailures": i(f"Drafter exits with code {C.EXIT_PEER_FRAME} (a peer's frame ended the "
                                 "drafter): counted apart, never toward drafter.maxFailures.", minimum=0),
        "drafterPeerFrames": o("Bookkeeping of the drafters' terminations for the current pods, by node index: "
                               "how many peer-frame exits were counted on that rank and which termination was "
                               "seen last (terminations (restartCount, plus a crash not yet restarted) minus "
                               "count = the rank's own failures).",
                               additionalProperties=o("One rank.", {
                                   "count": i("Peer-frame exits counted on the rank.", minimum=0),
                                   "last": s("The last failure seen (own or peer-frame): its finishedAt, else its "
                                             "containerID; one seen again is not counted again.", maxLength=64),
                               }), maxProperties=100000),
        "lastFailure": s("Last target failure, one line.", maxLength=32768),
        "startTime": s("When the pods of this run were first created.", format="date-time", nullable=True),
        "completionTime": s("When the job reached Succeeded or Failed.", format="date-time", nullable=True),
        "progress": o("Training progress reported by rank 0.", {
            "step": i("Last completed step."),
            "totalSteps": i("spec.target.steps."),
            "loss": n("Last training loss.", nullable=True),
            "tokensPerSecond": n("Throughput of the job.", nullable=True),
            "updatedAt": s("When rank 0 last reported.", nullable=True),
        }),
        C.STATUS_REPORTS: o("What each pod reports (the status path: written by the job's own pods, read by the "
                            "operator into progress and drafter), by pod UID. The operator deletes the "
                            "entries of pods that are gone.",
                            additionalProperties=o("One pod's reports.", {
                                C.REPORT_POD: s("The pod's name.", maxLength=253),
                                C.REPORT_PROGRESS: s("Rank 0's training progress, JSON.", maxLength=C.MAX_REPORT_CHARS),
                                C.REPORT_DRAFTER: s("The pod's drafter summary, JSON.", maxLength=C.MAX_REPORT_CHARS),
                            }), maxProperties=4 * MAX_NODES),
        "drafter": o("Drafter summary across ranks.", {
            "state": s("Drafter state.", enum=["Disabled", "Waiting", "Active", "Degraded"]),
            "activeRanks": i("Ranks whose drafter is Active.", minimum=0),
            "harvestedSeconds": n("Drafter busy time inside target idle windows, summed over ranks."),
            "harvestEfficiency": n("Harvested / usable idle time (mean over reporting ranks)."),
            "acceptanceLength": n("Expected accepted tokens per verification.", nullable=True),
            "artifact": s("Where the latest exported drafter is (only the exporting rank's pod's report, naming a "
                          "version directory of the job's export path, is taken)."),
            "reportFieldsRefused": i("Fields of the pods' drafter reports ignored in the last pass (not a state, "
                                     "a number out of range, an artifact not from the exporting rank or not "
                                     "under the export path): Event DrafterReportRefused names them.", minimum=0),
            "exportsRejectedByCause": counts("Candidate exports the export gate kept from LATEST, by cause: "
                                             "below_latest (under LATEST re-measured on the same held-back "
                                             "samples), below_floor (under spec.drafter.export.minAcceptance), "
                                             "non_finite, unmeasured, version_reused.",
                                             "Candidates rejected", C.EXPORT_REJECT_CAUSES),
            "combineAdjustedByCause": counts("Contributions the fleet's robust combine adjusted, by cause (the "
                                             "coordinator's counts): work_capped (claimed work above the rate of "
                                             "the coordinator's own clock), outlier_clipped (an update far from "
                                             "the round's median), weight_capped (a rank's weight in a round "
                                             "bounded).", "Contributions adjusted", C.COMBINE_ADJUST_CAUSES),
        }),
    })


def _dataclass_in(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    return next((a for a in getattr(hint, "__args__", ()) if dataclasses.is_dataclass(a)), None)


def workload_defaults(node: dict[str, Any], cls: type, path: str, skip: tuple[str, ...] = ()) -> None:
    """Give every optional leaf field of `node` that `cls` (a config dataclass) reads the dataclass's
    default; one the CRD lacks, or a default written in both places that differs, is an error."""
    hints = get_type_hints(cls)
    required = set(node.get("required", []))
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in skip:
            continue
        key = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), f.name)
        prop = (node.get("properties") or {}).get(key)
        if prop is None:
            raise ValueError(f"{path}.{key}: the workloads read it ({cls.__name__}.{f.name}) but the CRD lacks it")
        sub = _dataclass_in(hints[f.name])
        if sub is not None:
            workload_defaults(prop, sub, f"{path}.{key}")
            continue
        if f.metadata.get("schema_default", True) is False:   # config.NO_SCHEMA_DEFAULT: resolved in from_manifest
            if "default" in prop:
                raise ValueError(f"{path}.{key}: {cls.__name__}.{f.name} is resolved by config.from_manifest; the "
                                 "CRD must not default it (the apiserver's default would pre-empt the rule)")
            continue
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if key in required or value in ("", None) or prop.get("x-kubernetes-preserve-unknown-fields"):
            continue
        value = list(value) if isinstance(value, tuple) else value
        if "default" in prop and prop["default"] != value:
            raise ValueError(f"{path}.{key}: default {prop['default']!r} here, {value!r} in "
                             f"{cls.__name__}.{f.name}: keep the one in operator/spectrain_api/config.py")
        prop["default"] = value


def crd() -> dict[str, Any]:
    spec = spec_schema()
    workload_defaults(spec, W.JobConfig, "spec", skip=("name", "namespace"))
    schema = o("SpecTrainJob trains a speculative-decoding drafter in the idle GPU time of an LLM training job.", {
        "apiVersion": s("Versioned schema of this object."),
        "kind": s("REST resource kind of this object."),
        # The API server allows nothing on metadata but restrictions of name/generateName (not even
        # a description): the description of this node is the one of `name`.
        "metadata": {"type": "object", "properties": {
            "name": s(f"Job name: a DNS-1035 label of at most {MAX_NAME_LENGTH} characters so every child "
                      "name stays a valid DNS label.", maxLength=MAX_NAME_LENGTH, pattern=NAME_PATTERN),
        }},
        "spec": spec,
        "status": status_schema(),
    }, required=["spec"], rules=[
        rule(f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
             f"metadata.name must be at most {MAX_NAME_LENGTH} characters (child names add suffixes up to "
             f"{63 - MAX_NAME_LENGTH})"),
    ])
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "spectrain"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": "spectrainjob",
                      "shortNames": ["stj"], "categories": ["spectrain"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
                    {"name": "Ready", "type": "string", "jsonPath": ".status.ready",
                     "description": "Ready/desired pods."},
                    {"name": "Drafter", "type": "string", "jsonPath": ".status.drafter.state",
                     "description": "Drafter state."},
                    {"name": "Harvest", "type": "number", "jsonPath": ".status.drafter.harvestEfficiency",
                     "description": "Harvested / usable idle time."},
                    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts",
                     "description": "Whole-job restarts."},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp",
                     "description": "Time since creation."},
                ],
                "schema": {"openAPIV3Schema": schema},
            }],
        },
    }
