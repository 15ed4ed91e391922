# spectrain — the Makefile is the interface. `make help` lists the targets.
SHELL := /bin/bash
PY_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The release the suite runs against (the package allows a range); on this CPU machine the
# registry's default build, CUDA libraries included, runs on the CPU.
TORCH_PIN ?= torch==2.13.0
UV_PIN ?= uv==0.13.10
# The transformers release the HF-target tests ran against (the package allows >=5,<6).
HF_PIN ?= transformers==5.23.0
STAMP := $(VENV)/.installed
QUICK ?=
UNIT_WORKERS ?= auto
PYTEST_ARGS ?=
KUBE_CACHE ?= $(HOME)/.cache/spectrain/kube
BENCHES := $(sort $(basename $(notdir $(filter-out bench/__init__.py bench/common.py,$(wildcard bench/*.py)))))
BENCH_ALIASES := $(subst _,-,$(foreach b,$(BENCHES),$(if $(findstring _,$(b)),$(b))))   # bench-fleet-scale = bench-fleet_scale

.DEFAULT_GOAL := help
.PHONY: help install test test-unit test-integration test-stress test-e2e test-serving lint typecheck verify lock demo demo-rl demo-hf \
        kube-binaries kube-binaries-legacy prometheus-binaries crds docs clean gpu-check gate-replay images $(BENCHES:%=bench-%) \
        $(BENCH_ALIASES:%=bench-%)

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 22
	@printf '%-22sbench/<name>.py (QUICK=1: the <60 s version) -> bench/results/<name>.json; - for _ works too\n' 'bench-<name>'
	@printf '%-22s%s\n' '' '$(BENCHES:%=bench-%)'

# uv installs from its cache (~/.cache/uv) by hard links, where pip unpacks the multi-GB torch
# build (CUDA libraries included) every time (figures: README, "Build and test times").
$(STAMP): pyproject.toml
	$(PY_BOOT) -m venv $(VENV)
	$(PIP) install -q "$(UV_PIN)"
	$(VENV)/bin/uv pip install -q --python $(PY) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) \
	  "$(TORCH_PIN)" "$(HF_PIN)" -e '.[operator,workloads,dev]'
	touch $(STAMP)

install: $(STAMP) ## create .venv with everything (torch and transformers pinned)

test: $(STAMP) kube-binaries prometheus-binaries ## unit tests (on every core), then integration (real kube-apiserver, real Prometheus, real processes, the real cluster)
	$(PY) -m pytest tests -m "unit" -n $(UNIT_WORKERS) $(PYTEST_ARGS)
	$(PY) -m pytest tests -m "not unit and not e2e and not stress" --durations=30 $(PYTEST_ARGS)

test-unit: $(STAMP) ## unit tests only (about 2 min on 2 cores)
	$(PY) -m pytest tests -m unit -n $(UNIT_WORKERS) $(PYTEST_ARGS)

test-integration: $(STAMP) kube-binaries prometheus-binaries ## integration tier only
	$(PY) -m pytest tests -m "integration and not stress" $(PYTEST_ARGS)

test-stress: $(STAMP) ## long attack runs against a clean run side by side (the fleet's starvation; minutes)
	$(PY) -m pytest tests -m stress $(PYTEST_ARGS)

test-e2e: $(STAMP) ## e2e against the cluster in KUBECONFIG
	$(PY) -m pytest tests -m e2e --e2e $(PYTEST_ARGS)

test-serving: $(STAMP) ## optional, not in test: speculators 0.9.0 loads the EAGLE-3 exports (own venv .cache/serving-venv)
	VENV=$(VENV) bash scripts/serving_venv.sh $(PYTEST_ARGS)

kube-binaries: ## build kube-apiserver/-controller-manager/-scheduler, etcd, kwok, Kueue, scheduler-plugins (scripts/kube/) once from the Go module proxy
	bash scripts/build-kube-current.sh

prometheus-binaries: ## build prometheus and promtool (scripts/prometheus/) once from the Go module proxy, for the monitoring tests
	bash scripts/build-prometheus.sh

.PHONY: cluster-binaries cluster-up cluster-down
cluster-binaries: ## build kubelet, kube-proxy, containerd 2.x, CoreDNS, kube-router, pause (scripts/node/) once + apt deps, for the real two-node cluster
	bash scripts/cluster/build.sh

cluster-up: ## start a real two-node cluster (builds what is missing; own netns, containerd, kubelet per node); KUBECONFIG: scripts/cluster/cluster.sh env
	bash scripts/cluster/cluster.sh up

cluster-down: ## stop the real two-node cluster and leave the host clean (safe to run twice)
	bash scripts/cluster/cluster.sh down

kube-binaries-legacy: ## the old 1.20 tier from Debian source (~11 min), for SPECTRAIN_KUBE=1.20 and the below-range test
	KUBE_CACHE=$(KUBE_CACHE) bash scripts/build-kube.sh

lint: $(STAMP) ## ruff
	$(VENV)/bin/ruff check operator workloads tests bench scripts

typecheck: $(STAMP) ## mypy on the operator, the API package, the ring, the drafter fleet, the hooks API, the harvest engine, speculative decoding and the HF targets
	$(VENV)/bin/mypy --follow-imports=silent operator/spectrain_operator workloads/spectrain_workloads/ring \
	  operator/spectrain_api workloads/spectrain_workloads/{runtime,loop,topology,listen}.py workloads/spectrain_workloads/target/entry.py workloads/spectrain_workloads/rl/mode.py workloads/spectrain_workloads/drafter/{fleet,fleet_weights,links,replicas,fleet_records,listener,admission,auth,identity,checks,allreduce,ring_replicas,control,worker,worker_intake,worker_tasks,worker_export,export_latest,robust_combine,worker_reporting,eagle3,eagle3_export,eagle3_tables,eagle3_tasks,eagle3_assembly}.py
	$(VENV)/bin/mypy --follow-imports=silent workloads/spectrain_workloads/hooks workloads/spectrain_workloads/harvest \
	  workloads/spectrain_workloads/hf workloads/spectrain_workloads/specdec workloads/spectrain_workloads/{generate,target_model}.py

# Resolving needs the package index, so verify only checks the locks' recorded input hashes (offline).
lock: $(STAMP) ## regenerate the images' hashed lock files (operator/ and workloads/requirements.lock; needs PyPI)
	$(PY) scripts/lock.py

IMAGE ?= all
images: ## build the operator and CPU workloads images without Docker (root; Debian mmdebstrap + buildah; IMAGE=operator|workloads|all) -> ~/.cache/spectrain/images/*.tar
	bash scripts/images/build.sh $(IMAGE)

verify: $(STAMP) ## regenerate derived files (helm CRD copy, docs) and fail on a diff or a stale lock file
	$(PY) scripts/lock.py --check
	$(PY) scripts/gen.py
	@git diff --exit-code -- helm docs crds || (echo "derived files are stale: run 'python scripts/gen.py' and commit" && exit 1)
	@test -z "$$(git status --porcelain -- helm docs crds)" || (git status --porcelain -- helm docs crds; echo "untracked derived files: commit them" && exit 1)

demo: $(STAMP) ## run examples/demo.yaml locally (CPU, ~3 min) and print the headline figures
	rm -rf runs/demo
	$(VENV)/bin/spectrain run examples/demo.yaml --run-dir runs/demo --report

demo-rl: $(STAMP) ## run examples/demo-rl.yaml locally (mode RL, ~3 min)
	rm -rf runs/demo-rl
	$(VENV)/bin/spectrain run examples/demo-rl.yaml --run-dir runs/demo-rl --report

DEMO_HF_MODEL := /tmp/spectrain-demo-hf/model
demo-hf: $(STAMP) ## a tiny random HF Llama built offline, trained by examples/hf-tiny.yaml (CPU, ~2 min), then `spectrain generate`
	rm -rf runs/demo-hf $(DEMO_HF_MODEL)
	$(PY) -m spectrain_workloads.hf.tiny $(DEMO_HF_MODEL) --layers 8
	$(VENV)/bin/spectrain run examples/hf-tiny.yaml --run-dir runs/demo-hf --report
	$(VENV)/bin/spectrain generate --model runs/demo-hf/pvc/hf-tiny-run/target/hf --drafter runs/demo-hf/pvc/hf-tiny-run/drafter \
	  --prompt "def main(argv):" --max-new-tokens 48 --compare --repeats 21

RUN ?= runs/demo
RANK ?= 0
gate-replay: $(STAMP) ## what other gate confidences / margins would harvest of a run's windows (RUN=runs/demo RANK=0)
	$(PY) scripts/gate_replay.py $(RUN) --rank $(RANK)

# Explicit targets, not a pattern rule: GNU make never applies a pattern rule to a phony target.
$(BENCHES:%=bench-%) $(BENCH_ALIASES:%=bench-%): bench-%: $(STAMP)
	$(PY) -m bench.$(subst -,_,$*) $(if $(QUICK),--quick,)

# On a lent GPU machine: its own python3 and torch, no venv, nothing installed (GPU_PY overrides).
GPU_PY ?= python3
gpu-check: ## every CUDA path in one run (<= 8 min) -> bench/results/gpu.json + gpu.log; no CUDA: all skipped
	PYTHONPATH=operator:workloads:. $(GPU_PY) scripts/gpu_check.py

clean: ## remove the venv, runs and caches (not the kube and Prometheus binaries in ~/.cache)
	rm -rf $(VENV) runs bench/results .pytest_cache .mypy_cache .ruff_cache
