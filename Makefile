# The two commands of the quickstart. Both create .venv (once) and install the dependencies at
# the tested versions of constraints.txt (again only when pyproject.toml or constraints.txt
# changes), so a fresh clone needs nothing else.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Two processes: the demo's config is the CPU speedrun (DEVICE cpu), also on a machine with GPUs.
NPROC  ?= 2

.PHONY: demo test test-fast lint format venv clean images readme guide

venv: $(STAMP)

# A line before each step and one with the time it took; pip's own progress shows on a terminal
# (the first install downloads torch: minutes), and a log that is not a terminal (CI, `make test >
# log`) gets pip's --quiet.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || { echo "make: creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "make: installing distribuuuu and its dependencies at the versions of constraints.txt into $(VENV) (the first time: a few minutes, torch is large)"
	@start=$$(date +%s); quiet=--quiet; if [ -t 1 ]; then quiet=; fi; \
	$(PY) -m pip install $$quiet --disable-pip-version-check -c constraints.txt -e ".[dev]" && \
	echo "make: $(VENV) is ready ($$(( $$(date +%s) - start )) s)"
	@touch $(STAMP)

demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/distribuuuu train --cfg config/mnist5k_fast.yaml --nproc-per-node $(NPROC) OUT_DIR runs/demo

# Every test, the CI command (.ci/run). Two pytest-xdist workers, one test file each at a time
# (--dist loadfile: a module's fixtures are built once): 22 minutes of pytest on an idle 2-core machine
# (959 tests, `time make test`); most of it is the e2e tests' process starts (about 4 s of imports
# each: timm alone takes ~3.8 s) and the commands of the README and docs pages (make readme).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The in-process tier: every test not marked e2e (none starts the command, a launcher or a
# spawner) nor slow (an in-process training run checked for accuracy: tests/conftest.py), on two
# xdist workers: 27 s on an idle 2-core machine, against 42 s in one process (FAST_JOBS=0), both
# measured one after the other. On cores busy with other jobs one process can be the quicker.
FAST_JOBS ?= 2
test-fast: $(STAMP)
	$(PY) -m pytest -q $(if $(filter-out 0,$(FAST_JOBS)),-n $(FAST_JOBS)) -m "not e2e and not slow" tests

# ruff (its rules are in pyproject.toml): every package module, tests, benchmarks and scripts; CI runs it.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check distribuuuu

# Format the package (ruff format at pyproject.toml's line length).
format: $(STAMP)
	$(VENV)/bin/ruff format distribuuuu

images: $(STAMP)
	scripts/make_readme_images.sh

# Run the commands of the README and of the docs pages it runs (scripts/readme_outputs.py's DOCUMENTS),
# in order, in a new folder, and rewrite the output blocks whose shape changed, in each file (about
# 3 minutes on 2 cores); tests/test_readme.py runs the same and fails on drift.
readme: $(STAMP)
	$(PY) scripts/readme_outputs.py --write

# Trace a default 2-rank torchrun run and rewrite docs/reading-guide.md from it: the package code it
# executes, in order, with sizes (about a minute on 2 cores); tests/test_layout.py fails on drift.
guide: $(STAMP)
	$(PY) scripts/trace_run.py --write

clean:
	rm -rf runs .pytest_cache
