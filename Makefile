# `make demo` and `make test` create .venv when it is missing; everything is installed with
# constraints.txt so that torch stays on the CPU build (an unpinned torch pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint check-gpu-install test-all test-verl test-gpu gpu-smoke test-cluster rehearse-verl figures clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	@if [ -f sweeps/quickstart.yaml ]; then $(BIN)/emapg sweep sweeps/quickstart.yaml; \
	else echo "The quickstart sweep is not built yet (issue: sweeps); run 'make test' meanwhile."; fi

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/vermin -q --no-tips --violations --eval-annotations -t=3.10- \
		ema_pg_core experiments sweeps analysis cluster benchmarks tests  # stdlib APIs exist on Python 3.10

# The GPU install (cluster/gpu-install.sh, its one source; docs/scaling-out.md) resolved for a Linux x86_64
# CUDA 13 machine with wheels only: pip --dry-run reads the wheels' metadata and downloads no CUDA wheel. For
# this .venv's Python and each python3.10-3.12 on PATH that runs, about a minute each (cluster/gpu_install.py). Fails when it does
# not resolve, would build anything but antlr4's pure-Python sdist, or would install flash-attn.
check-gpu-install: $(STAMP)
	$(BIN)/python -m cluster.gpu_install

# The verl plugin's CPU tests (marked `verl`) and the rehearsals in their own venv, on the GPU users' stack:
# the versions of cluster/gpu-lock.txt (torch 2.11's CUDA build, run on the CPU; transformers; verl 0.9.1),
# constraints.txt's for the test tools. About 6 GB that `make test` does not need.
VERL_VENV  := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed

$(VERL_STAMP): pyproject.toml constraints.txt cluster/gpu-lock.txt
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q -U pip
	$(VERL_VENV)/bin/python -m cluster.gpu_install --ci-constraints > $(VERL_VENV)/constraints.txt
	$(VERL_VENV)/bin/python -m pip install -q -c $(VERL_VENV)/constraints.txt -e ".[dev,verl]"
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -m "verl and not gpu" tests/verl

# Both shipped GPU sweeps through Ray Tune on a local two-node CPU cluster at world size 2: two trials at
# once, a node lost, the driver killed and resumed (docs/scaling-out.md). About 8 minutes each on 2 cores.
rehearse-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/emapg rehearse sweeps/math_deepscaler_ema_pg.yaml --layout across
	$(VERL_VENV)/bin/emapg rehearse sweeps/search_r1_ema_pg.yaml --layout within

# Every gpu-marked test (the local trainer on CUDA, the fused Top-k and the EMA update against their CPU
# references, verl's offload then the EMA) with whatever Python has the CUDA build of torch: the .venv above
# holds the CPU build. Needs torch and transformers only. `make test-gpu PYTHON=/path/to/python GPU_ARGS=--allow-skip`
test-gpu:
	$(PYTHON) tests/run_gpu.py $(GPU_ARGS)

# The first thing to run on a new GPU cluster, on one GPU of the GPU install (cluster/gpu-install.sh): test-gpu,
# emapg doctor and emapg rehearse --device cuda (verl's loop with vLLM), then one verdict line per stage, logs in
# outputs/gpu-smoke/ (cluster/gpu_smoke.py; docs/scaling-out.md). `make gpu-smoke PYTHON=/path/to/python`
gpu-smoke:
	$(PYTHON) -m cluster.gpu_smoke

# The rendered SLURM job under stub srun/scontrol that start real local Ray nodes: two jobs at once, two sharing a
# worker node, a sweep at its time limit and one preempted (each resumed), a job in a container, a worker lost;
# and (fast) the port choice: another user's lock files, blocks held on a worker (about 6 minutes on 2 cores).
test-cluster: $(STAMP)
	$(BIN)/python -m pytest -m "slow or not slow" tests/cluster/test_slurm_job.py

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu and not verl"

figures: $(STAMP)
	$(BIN)/emapg figures --out outputs/figures

clean:
	rm -rf $(VENV) $(VERL_VENV) outputs
