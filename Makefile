# make demo: memfit and the report's plotting only (torch, numpy, rich, matplotlib: no
# framework extra) and a one-minute run of a small built-in GPT on the built-in corpus
# under a memory budget.
# make test: lint, format check, the import contract and the test suite (CPU, a few minutes),
# then the kernel-sensitive tests again on an emulated AVX2-only CPU (make test-older-cpu);
# it installs the extras the tests use (every framework memfit integrates with).
# Both create .venv when it is missing and reuse it afterwards.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memfit-installed
CORE_STAMP := $(VENV)/.memfit-core

.PHONY: install demo test test-older-cpu lint format bench clean

$(CORE_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,plot,tensorboard,hf,integrations,keras]'
	touch $(STAMP)

install: $(STAMP)

# The demo's own environment: memfit and matplotlib (the report's figures).
DEMO_STAMP := $(VENV)/.memfit-demo
$(DEMO_STAMP): $(CORE_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[plot]'
	touch $(DEMO_STAMP)

# A fresh runs/demo each time (the same --out would continue the finished run instead).
DEMO_FLAGS := --steps 60 --set n_layer=4 --set n_embd=128 --budget 60MiB
demo: $(DEMO_STAMP)
	rm -rf runs/demo
	$(BIN)/memfit train --out runs/demo $(DEMO_FLAGS)
	@echo
	@echo "What the demo showed: a 0.84M-parameter GPT trained 60 steps on the built-in corpus,"
	@echo "its precision chosen by measuring this device (the 'precision auto' line), its"
	@echo "activations planned under a 60 MiB budget (unplanned it peaks at about 82 MiB):"
	@echo "the summary gives the measured peak against the budget and the recompute it cost,"
	@echo "the health table the checks that apply. Next: runs/demo/report/report.html,"
	@echo "'memfit report runs/demo', 'memfit tune --help' (README.md, Quick start)."

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The tests whose verdicts touch kernels, their workspace, timing or the choice of precision,
# run again on an emulated AVX2-only CPU: ATen's vectorized kernels and oneDNN's JIT (and
# MKL's) limited to AVX2, so bf16 matmuls and convolutions are emulated and the bf16 LSTM
# has no kernel, as on such a CPU. TensorFlow's own kernels do not follow these limits
# faithfully, so the Keras tests run natively only.
OLDER_CPU := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
OLDER_CPU_TESTS := tests/test_storage.py tests/test_kernels.py tests/test_models.py tests/test_policy.py \
	tests/test_master.py tests/test_precision_timing.py tests/test_checkpoint_api.py \
	tests/test_step_memory.py tests/test_measured_fit.py tests/test_profile.py \
	tests/test_plan.py tests/test_apply.py tests/test_memory.py tests/test_estimate.py \
	tests/test_engine.py tests/test_engine_feed.py tests/test_tune.py \
	tests/test_integrations.py tests/test_verify.py tests/test_least_peak.py \
	tests/test_optimizer_state.py tests/test_release.py tests/test_edges.py \
	tests/test_rounded_weights.py tests/test_peers.py

test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile
	$(MAKE) --no-print-directory test-older-cpu

test-older-cpu: $(STAMP)
	$(OLDER_CPU) $(BIN)/python -m pytest -q -n 2 --dist loadfile $(OLDER_CPU_TESTS)

bench: $(STAMP)
	$(BIN)/python bench/precision.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# make test-floors: the tests of the optional frameworks (Hugging Face with its zoo,
# Lightning, Keras on TensorFlow, matplotlib, TensorBoard) on the lowest versions that
# pyproject.toml claims, pinned in constraints-floors.txt, in a second environment
# (.venv-floors, created when missing and reused afterwards). make test runs the newest.
FLOORS_VENV ?= .venv-floors
FLOORS_BIN := $(FLOORS_VENV)/bin
FLOORS_STAMP := $(FLOORS_VENV)/.memfit-installed
FLOORS_TESTS = $(shell grep -l -E 'transformers|lightning|keras|matplotlib|tensorboard' tests/test_*.py)

.PHONY: test-floors

$(FLOORS_STAMP): pyproject.toml constraints-floors.txt
	test -x $(FLOORS_BIN)/python || $(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_BIN)/python -m pip install -q --upgrade pip
	$(FLOORS_BIN)/python -m pip install -q -c constraints-floors.txt -e '.[dev,plot,tensorboard,hf,integrations,keras]'
	touch $(FLOORS_STAMP)

test-floors: $(FLOORS_STAMP)
	$(FLOORS_BIN)/python .ci/check_floors.py constraints-floors.txt
	$(FLOORS_BIN)/python -m pytest -q -p no:cacheprovider -rfEs $(FLOORS_TESTS)
