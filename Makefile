# MM-LDLM: the targets the README names.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test clean

install: $(STAMP)

# Reinstall only when the dependency set or the package metadata changes.
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -e .
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
