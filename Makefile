# geserve: `make run` serves model_repository/, `make test` runs lint, types and the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_VENV := $(VENV)/.made
STAMP_RUN := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test
STAMP_MODELS := $(VENV)/.installed-models

.PHONY: FORCE run test test-multiprocess lint typecheck unit protos models bench bench-ab bench-peers bench-npu bench-npu-peers soak chaos check-oldest check-uvicorn npu-check clean

# Every time: makes $(VENV) with $(PYTHON), again when its Python no longer runs, is older than pyproject.toml's
# requires-python, or is another major.minor than a PYTHON given on the command line or in the environment; refuses
# a $(PYTHON) older than requires-python, saying so. $(STAMP_VENV) changes only when the venv is made.
# A host without the default python3 (only python3.11, say) keeps using a venv that runs; with no venv either, make
# says to name one.
PYTHON_CHOSEN := $(if $(filter command line environment environment override,$(origin PYTHON)),--python-chosen)
$(STAMP_VENV): FORCE
	@if command -v '$(PYTHON)' >/dev/null 2>&1 || [ -n '$(PYTHON_CHOSEN)' ]; then \
		'$(PYTHON)' scripts/ensure_venv.py --venv '$(VENV)' --python-name '$(PYTHON)' $(PYTHON_CHOSEN); \
	elif '$(BIN)/python' -c '' >/dev/null 2>&1; then \
		'$(BIN)/python' scripts/ensure_venv.py --venv '$(VENV)' --python-name '$(BIN)/python'; \
	else \
		echo "ensure_venv: no '$(PYTHON)' on PATH and no $(VENV) that runs: name a Python >=3.11," \
			"e.g. \`make run PYTHON=python3.11\`" >&2; \
		exit 1; \
	fi

$(STAMP_RUN): pyproject.toml $(STAMP_VENV)
	$(BIN)/python -m pip install -q -e '.[onnx]'
	touch $@

$(STAMP_TEST): pyproject.toml $(STAMP_VENV)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@ $(STAMP_RUN) $(STAMP_MODELS)

# The ports `make run` serves on, e.g. `make run HTTP_PORT=9000 GRPC_PORT=9001 METRICS_PORT=9002` beside another server.
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002

run: $(STAMP_RUN)
	$(BIN)/geserve --model-repository=model_repository --http-port=$(HTTP_PORT) --grpc-port=$(GRPC_PORT) \
		--metrics-port=$(METRICS_PORT)

lint: $(STAMP_TEST)
	$(BIN)/ruff check geserve tests scripts model_repository
	$(BIN)/ruff format --check geserve tests scripts model_repository

typecheck: $(STAMP_TEST)
	$(BIN)/mypy

# Test processes per pass (pytest-xdist), each taking whole files so that a file's shared servers start once: the
# end-to-end tests mostly wait on their servers, so three keep two cores busy.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=25

# The whole suite with every server one process, then the end-to-end tests the process layout can change again with
# each server a supervisor, an engine and two protocol processes (--frontend-processes=2). The files marked
# one_layout hold what only the engine, the workers and the backends do (or choose their layouts themselves).
test: lint typecheck
	$(PYTEST)
	$(MAKE) --no-print-directory test-multiprocess

test-multiprocess: $(STAMP_TEST)
	GESERVE_TEST_FRONTEND_PROCESSES=2 $(PYTEST) -m "not one_layout" tests/e2e

protos: $(STAMP_TEST)
	$(BIN)/python scripts/gen_protos.py

# geserve with the oldest protobuf, grpcio, numpy and tritonclient it supports, in build/oldest-venv.
check-oldest: $(STAMP_TEST)
	$(BIN)/python scripts/check_oldest.py

# The HTTP transport's tests with the oldest and the newest uvicorn that pyproject.toml allows (build/uvicorn-*).
# CHECK_UVICORN_FLAGS=--skip-installed leaves out the environment's own uvicorn (`make test` just tested it).
CHECK_UVICORN_FLAGS ?=
check-uvicorn: $(STAMP_TEST)
	$(BIN)/python scripts/check_uvicorn.py $(CHECK_UVICORN_FLAGS)

# scripts/make_models.py needs the models extra and nothing of geserve itself, so only the extra's requirements are
# installed (read from pyproject.toml), not geserve: no editable install, whose geserve.egg-info would land in the
# tree. What `make models` writes is .venv/ and model_repository/'s ONNX models and digits samples, the same bytes
# as those committed (tests/unit/test_make_models.py): a fresh clone stays clean.
$(STAMP_MODELS): pyproject.toml $(STAMP_VENV)
	$(BIN)/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["models"]))' \
		| $(BIN)/python -m pip install -q -r /dev/stdin
	touch $@

models: $(STAMP_MODELS)
	$(BIN)/python scripts/make_models.py

# Benchmarks print ratios measured in one run; they are never part of `make test`.
bench: $(STAMP_TEST)
	$(BIN)/python -m tests.perf.bench_worker
	$(BIN)/python -m tests.perf.bench_server

# The same perf_analyzer runs against another revision (BASE) and this tree (or CANDIDATE), alternating rounds.
BASE ?= HEAD~1
CANDIDATE ?=
bench-ab: $(STAMP_TEST)
	$(BIN)/python -m tests.perf.bench_ab --base $(BASE) $(if $(CANDIDATE),--candidate $(CANDIDATE))

# A ResNet-50-shaped .om on 1 and 2 simulated NPUs (t(b) = 2 ms + 0.5 ms x b), device-bound, over HTTP, gRPC and
# system shared memory, with --frontend-processes 1 and 2 A/B per point (medians of two rounds); prints the modes
# side by side, CPU per image by process role and a 16-core, 8-NPU host projected from it, and writes
# bench-results/npu-<timestamp>.json. BENCH_ARGS narrows it, e.g. BENCH_ARGS="--devices 2 --concurrency 64".
BENCH_ARGS ?=
bench-npu: $(STAMP_TEST)
	$(BIN)/python -m tests.perf.bench_npu $(BENCH_ARGS)

# The same NPU-bound workload on Triton (PyTriton's tritonserver, python backend) and MLServer, each model
# sleeping t(b) for a batch of b; A/B per point, alternating servers (geserve once per --frontend-processes mode),
# medians of two rounds. The peers are installed in their own venvs under ~/.cache/geserve-bench on first use.
bench-npu-peers: $(STAMP_TEST)
	$(BIN)/python -m tests.perf.bench_npu_peers $(BENCH_ARGS)

# The same perf_analyzer runs against MLServer 1.7.1 (installed in its own venv under ~/.cache).
bench-peers: $(STAMP_TEST)
	$(BIN)/python -m tests.perf.bench_peers

# Reliability runs, never part of `make test`; each writes a JSON report under build/ and fails on a lost or
# wrong answer. soak: mixed checked traffic for SOAK_SECS, with RSS, descriptors and /dev/shm sampled.
# chaos: workers killed, SIGTERM (to the server and to its process group), a nearly full /dev/shm (private mount
# namespace), a shrunk client region, a flood of client regions, hostile clients, BLS cycles, oversized ids and
# parameters, large JSON bodies beside a liveness probe, SIGTERM during a warmup that never returns, an object store
# that hangs.
SOAK_SECS ?= 600
soak: $(STAMP_TEST)
	@mkdir -p build
	SOAK_SECS=$(SOAK_SECS) SOAK_REPORT=build/soak-report.json $(BIN)/python -m tests.reliability.soak

chaos: $(STAMP_TEST)
	@mkdir -p build
	CHAOS_REPORT=build/chaos-report.json $(BIN)/python -m tests.reliability.chaos

# On an Ascend host, after `source /usr/local/Ascend/ascend-toolkit/set_env.sh`:
#   make npu-check GESERVE_NPU_OM=/path/model.om [GESERVE_NPU_ONNX=/path/model.onnx] [GESERVE_NPU_DEVICES=0,1]
#                  [PYTHON=python3.11]
# scripts/npu_preflight.py runs first, on $(PYTHON), and lists every problem it finds (Python version, set_env.sh,
# CANN permissions, pyACL, devices, the .om) before anything is installed; then only the npu-check extra is
# installed into $(VENV), not the whole test extra.
STAMP_NPU := $(VENV)/.installed-npu-check

$(STAMP_NPU): pyproject.toml $(STAMP_VENV)
	$(BIN)/python -m pip install -q -e '.[npu-check]'
	touch $@

npu-check:
	$(PYTHON) scripts/npu_preflight.py --venv $(VENV)
	$(MAKE) --no-print-directory $(STAMP_NPU)
	$(BIN)/geserve inspect "$(GESERVE_NPU_OM)"
	GESERVE_NPU_REQUIRED=1 GESERVE_NPU_OM="$(GESERVE_NPU_OM)" $(BIN)/python -m pytest -m npu -p no:cacheprovider \
		-o timeout=1800 -v -rs tests/e2e/test_npu.py

clean:
	rm -rf $(VENV) build *.egg-info
