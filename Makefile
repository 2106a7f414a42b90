# Two commands do all the setup:
#   make lab    build .venv if it is missing, then open the notebooks in JupyterLab
#   make test   build .venv if it is missing, then run the tests and execute every notebook
VENV ?= .venv
PYTHON ?= python3
# The CPU build of torch; on a GPU machine use e.g. `make TORCH=torch==2.13.0 ...`
# with your CUDA index configured in pip.
TORCH ?= torch==2.13.0
EXTRAS ?= lab,dev
PY := $(VENV)/bin/python
STAMP := $(VENV)/.grpo-lab-installed
JOBS ?= 2

.PHONY: lab test test-fast notebooks lint format bench student-notebooks train clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

test: $(STAMP)
	$(VENV)/bin/ruff check grpo_lab tests benchmarks
	$(PY) -m pytest -n $(JOBS) --dist worksteal --durations=15 tests
	$(PY) -m pytest -n $(JOBS) --dist loadfile --durations=0 --nbval-lax notebooks

test-fast: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile -m "not slow" tests

notebooks: $(STAMP)
	$(PY) -m pytest -n $(JOBS) --dist loadfile --durations=0 --nbval-lax notebooks

lint: $(STAMP)
	$(VENV)/bin/ruff check grpo_lab tests benchmarks
	$(VENV)/bin/ruff format --check grpo_lab tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format grpo_lab tests benchmarks
	$(VENV)/bin/ruff check --fix grpo_lab tests benchmarks

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS),bench]"
	$(PY) benchmarks/run_cpu.py

student-notebooks: $(STAMP)
	$(VENV)/bin/grpo-lab student-notebooks student_notebooks

train: $(STAMP)
	$(VENV)/bin/grpo-lab train

clean-venv:
	rm -rf $(VENV)
