# MM-LDLM: the targets the README names.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install lint test test-all train clean

install: $(STAMP)

# Reinstall only when the dependency set or the package metadata changes.
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -e .
	touch $(STAMP)

# Formatting and lint rules: pyproject.toml [tool.ruff]. `ruff format .` fixes the first.
lint: install
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .

# The fast tier, what every contributor runs: every module's behaviour, in minutes. The slow scenarios
# (marker `slow` in pyproject.toml: torchrun, the two-node launcher, cold compiles, long runs) are
# left to `make test-all`, which CI runs. docs/testing.md says what each tier covers.
# The fast tier runs in one test process per core, at most 4 (beyond, its longest file bounds the
# time), each with torch on one thread (tests/conftest.py); a file's tests share a process, so a
# module's fixture is built once. TEST_PROCS=0 runs them all in one process. The slow tier runs in
# one: its torchrun, launchers and compilers would compete with another test's processes for the cores.
TEST_PROCS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
FAST := -m "not slow" -n $(TEST_PROCS) --dist loadfile

test: lint
	$(PY) -m pytest -q $(FAST)

test-all: lint
	$(PY) -m pytest -q $(FAST)
	$(PY) -m pytest -q -m slow

# The main job: prepare the bundled corpus (first time only, cached), train configs/default.yaml
# with a progress bar; checkpoints and metrics go to runs/default/. Running it again continues.
# A run stopped by a signal exits 128 + its number, so the evaluation below does not run on it.
# Then a quick evaluation of the last checkpoint (about a minute): what the model writes alone (one
# text per latent, no encoder in the loop) next to the sources, and the figures; the whole report with
# the default decoder is `mmldlm eval --run runs/default` (9-17 minutes on one thread).
# Threads auto (training's too, configs/default.yaml): every core of an idle machine, fewer beside other
# jobs (on 2 cores shared with one busy process, two torch threads ran 6-8x slower than one).
train: install
	$(PY) -m mmldlm.cli train --config configs/default.yaml --resume auto
	$(PY) -m mmldlm.cli eval --run runs/default --num-samples 128 --threads auto --best-of 1 --no-writing --if-missing

clean:
	rm -rf $(VENV) .pytest_cache
