{{/* Chart name, truncated to a DNS label. */}}
{{- define "spectrain-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart> unless the release already contains the chart name. */}}
{{- define "spectrain-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "spectrain-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "spectrain-operator.labels" -}}
helm.sh/chart: {{ include "spectrain-operator.chart" . }}
{{ include "spectrain-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: spectrain
{{- end }}

{{/* Labels the Deployment, PDB and Service select pods by. */}}
{{- define "spectrain-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spectrain-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "spectrain-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "spectrain-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "spectrain-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* "true" when leader election is on: forced by leaderElection.enabled, or auto with replicaCount > 1. */}}
{{- define "spectrain-operator.leaderElection" -}}
{{- $e := .Values.leaderElection.enabled }}
{{- if eq (toString $e) "auto" }}
{{- if gt (int .Values.replicaCount) 1 }}true{{ else }}false{{ end }}
{{- else if $e }}true{{ else }}false{{ end }}
{{- end }}

{{/*
"true" for a cluster-wide install (clusterWide: a ClusterRole + ClusterRoleBinding, every namespace
watched), else "false". clusterWide together with a non-empty watchNamespaces fails the render.
*/}}
{{- define "spectrain-operator.clusterWide" -}}
{{- if and .Values.clusterWide .Values.watchNamespaces }}
{{- fail (printf "clusterWide: true and watchNamespaces: [%s] exclude each other (clusterWide watches every namespace). Set clusterWide=false to watch only the listed namespaces, or watchNamespaces=[] to watch every namespace." (join ", " .Values.watchNamespaces)) }}
{{- end }}
{{- if .Values.clusterWide }}true{{ else }}false{{ end }}
{{- end }}

{{/*
The namespaces the operator watches and gets a Role + RoleBinding in, as a JSON list (read it with
`include ... | fromJsonArray`): watchNamespaces when set, else the release namespace; empty for a
cluster-wide install (every namespace). The one place this rule lives: RBAC, the Deployment's
--namespace args and NOTES.txt all use it.
*/}}
{{- define "spectrain-operator.watchedNamespaces" -}}
{{- if eq (include "spectrain-operator.clusterWide" .) "true" }}
{{- list | toJson }}
{{- else }}
{{- default (list .Release.Namespace) .Values.watchNamespaces | toJson }}
{{- end }}
{{- end }}

{{/* The operator's rules on namespaced resources (a ClusterRole cluster-wide, a Role per watched namespace). */}}
{{- define "spectrain-operator.namespacedRules" -}}
# SpecTrainJobs: listed and watched by kopf (event handlers only: it adds no finalizer and no
# annotations; `patch` lets it remove the finalizer that operator versions with kopf timers put on
# older jobs); the reconciler reads one fresh per pass, deletes it after ttlSecondsAfterFinished
# and writes the status subresource. Never created.
- apiGroups: ["spectrain.io"]
  resources: ["spectrainjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["spectrain.io"]
  resources: ["spectrainjobs/status"]
  verbs: ["patch"]
# Pods: one per node. Listed by the job's label each pass, watched for kubelet updates, created
# and deleted (restart, suspend, failure); never changed (patch: features.kueue below).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["create", "list", "watch", "delete"]
# Children created once per job; the garbage collector deletes them through their ownerReferences,
# so no patch/delete. `get`: on 409 AlreadyExists the existing object's ownerReferences UID is
# compared with the job's (an object of another owner is an error on the job, never adopted).
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["create", "get"]
# The per-job fleet key (Secret <job>-fleet-key) and the per-pod fleet identities (Secrets
# <job>-fleet-id-<generation>-<node>), owned by the job and mounted only into the drafter
# containers: created, never read back or updated; the job's status records what was created.
# `delete`: a restart generation's identities once its pods are gone, and those of a generation whose
# creation was interrupted (before any of its pods exist); the garbage collector deletes the rest
# with the job. No get/list/watch: the operator cannot read any Secret.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "delete"]
# The per-job NetworkPolicy (<job>, owned by the job; spec.networkPolicy.enabled, on by default):
# created once before the job's pods (`get`: the owner check on 409); the garbage collector
# deletes it with the job, so no update/delete.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "get"]
# The per-job status path: a Role allowing `patch` on the job's own status and `get` on the job
# (both held above: RBAC lets a subject grant only what it holds) and its RoleBinding (`get`: the
# owner check on 409).
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create", "get"]
# spec.target.checkpoint.claimName / drafter.export.claimName / pvc:// data: checked to exist
# before anything is created (a missing claim is SpecInvalid, not a Pending pod).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
# Events on the SpecTrainJob (phase changes, restarts, failures; kopf's handler events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.features.kueue }}
# Kueue's plain-pod-group integration: a queued job's pods are annotated
# kueue.x-k8s.io/retriable-in-group=false when the job ends or is deleted, so Kueue lets the group go.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["patch"]
{{- end }}
{{- if .Values.features.dra }}
# gpuSharing.mode DRA: a ResourceClaimTemplate per job (MPS sharing config), owned by the job.
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaimtemplates"]
  verbs: ["create", "get"]
{{- end }}
{{- if has "SchedulerPlugins" .Values.features.gangProviders }}
# scheduling.gang.provider SchedulerPlugins (coscheduling): a PodGroup per job, owned by the job.
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["create", "get"]
{{- end }}
{{- if has "Volcano" .Values.features.gangProviders }}
# scheduling.gang.provider Volcano: a PodGroup per job, owned by the job.
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["create", "get"]
{{- end }}
{{- end }}

{{/* The label the operator puts on every object of a SpecTrainJob (spectrain_operator.objects.LABEL_JOB). */}}
{{- define "spectrain-operator.jobLabel" -}}
spectrain.io/job-name
{{- end }}
