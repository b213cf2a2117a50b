# make install: create .venv, install everything and build the C++ kernels (csrc/ -> engine/_native*.so).
# make test: install, then run the test suite. make demo: install, then the main job: a small GPT trained in
# bf16 and under each FP8 recipe, compared. After a csrc/ edit, test / demo / install / build rebuild the
# kernels (ninja recompiles only what changed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BUILT := $(VENV)/.built
# what the kernels are built from: every file under csrc/, and how they are built
CSRC := $(shell find csrc -type f)
BUILD_INPUTS := $(CSRC) setup.py engine/ops/native_build.py

.PHONY: test demo install build clean

install: $(BUILT)

# torch first (numpy too: torch warns without it when setup.py imports it): on these machines 2.13.0 is a
# local CPU build, and a bare `torch` would pull CUDA wheels. The build needs torch importable
# (--no-build-isolation: an isolated build would install a torch of its own).
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 numpy ninja setuptools wheel
	@start=$$(date +%s); \
	$(PY) -m pip install --quiet --no-build-isolation -e '.[test]' && \
	echo "engine: pip install -e . (with the C++ kernels' build) took $$(( $$(date +%s) - start )) s"
	touch $(STAMP) $(BUILT)

# a csrc/ edit after the install: rebuild in place (objects kept in build/temp; right after the install
# ninja finds nothing to do)
$(BUILT): $(BUILD_INPUTS) | $(STAMP)
	$(PY) setup.py --quiet build_ext --inplace
	touch $(BUILT)

build: $(BUILT)

test: $(BUILT)
	$(PY) -m pytest -q

demo: $(BUILT)
	$(PY) -m engine train

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis engine/_native*.so
