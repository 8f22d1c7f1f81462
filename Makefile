# gpupool — the README's two promises: `make demo` and `make test`.
# Everything is installed from nothing: a virtualenv in .venv, Debian packages, Kafka jars and
# the Kubernetes control plane's binaries (both cached outside the repo in $(GPUPOOL_CACHE)).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export GPUPOOL_CACHE ?= $(HOME)/.cache/gpupool
export GPUPOOL_STATE ?= $(CURDIR)/.state

.PHONY: demo test lint venv deps-system deps-kafka deps-kubernetes deps services-up services-down bench clean

$(BIN)/gpupool: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[server,test]'
	touch $@

## The compiled scrape decoder of analytics (analytics/native: Rust, pyo3, built by maturin) into
## .venv; cargo's build directory is cached outside the repo, so a rebuild is incremental. Needs
## cargo (deploy/local/install-system.sh installs Debian's when none is found; rustup's in
## ~/.cargo/bin is used first).
NATIVE := analytics/native
$(VENV)/.analytics-native: $(BIN)/gpupool $(NATIVE)/Cargo.toml $(NATIVE)/Cargo.lock $(NATIVE)/pyproject.toml $(NATIVE)/analytics_native.pyi $(wildcard $(NATIVE)/src/*.rs)
	PATH="$(HOME)/.cargo/bin:$$PATH" CARGO_TARGET_DIR="$(GPUPOOL_CACHE)/cargo-target" $(BIN)/pip install -q ./$(NATIVE)
	touch $@

venv: $(BIN)/gpupool $(VENV)/.analytics-native

deps-system:
	bash deploy/local/install-system.sh

deps-kafka:
	bash deploy/local/kafka-fetch.sh

## kube-apiserver, -scheduler, -controller-manager, kwok, Kueue built from the Go module proxy, etcd
## from Debian's .deb: minutes from an empty cache, nothing when cached (deploy/local/kubernetes-build.sh).
deps-kubernetes:
	bash deploy/local/kubernetes-build.sh

deps: deps-system venv deps-kafka deps-kubernetes

## The main job on embedded defaults: simulator + every stage in one process. Fabric isolation
## on a simulated InfiniBand fabric when its tools are installed (DEMO_FABRIC=auto|on|off).
DEMO_FABRIC ?= auto
demo: venv
	$(BIN)/gpupool demo --fabric $(DEMO_FABRIC) $(DEMO_ARGS)

## Lint and types first (rules and strictness in pyproject.toml): ruff, then mypy.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

## The whole test suite; services (Kafka, Mosquitto) are started by the tests' session fixtures.
test: deps lint
	PATH="$(HOME)/.cargo/bin:$$PATH" CARGO_TARGET_DIR="$(GPUPOOL_CACHE)/cargo-target" PYO3_PYTHON="$(CURDIR)/$(BIN)/python" \
		cargo test -q --release --manifest-path $(NATIVE)/Cargo.toml
	$(BIN)/python -m pytest $(PYTEST_ARGS)

services-up: deps
	bash deploy/local/kafka.sh start
	bash deploy/local/mosquitto.sh start

services-down:
	-bash deploy/local/kubernetes.sh stop
	-bash deploy/local/kafka.sh stop
	-bash deploy/local/mosquitto.sh stop

bench: venv
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean: services-down
	rm -rf $(GPUPOOL_STATE)
