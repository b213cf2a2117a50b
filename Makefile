# make test: create .venv from scratch, install everything, run the test suite.
# make demo: the main job: a small GPT trained in bf16 and under each FP8 recipe, compared.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin torch first: on these machines 2.13.0 is a local CPU build; a bare `torch` would pull CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m engine train

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
