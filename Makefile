# make demo: train the built-in GPT on the built-in corpus for a short run.
# make test: lint, format check, the import contract and the test suite (CPU, a few minutes).
# Both create .venv when it is missing and reuse it afterwards.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memfit-installed

.PHONY: install demo test lint format bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,plot,tensorboard,hf,integrations,keras]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/memfit train

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python bench/precision.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
