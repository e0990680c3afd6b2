# `make test` and `make decode` are the whole set-up: each creates .venv on first use.
# `make docs` builds the documentation site into docs/_build/html (offline, warnings as errors).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= def fibonacci(n):
ARGS ?= --max-new-tokens 128

CONFIG ?= configs/embedded.py:quick
WORKDIR ?= runs/quick

.PHONY: install test docs decode train clean speculators-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

# speculators 0.9.0 in a venv of its own, for tests/test_speculators_interop.py: made once per
# machine outside the checkout (2-5 minutes, 1.5 GB), reused after; where it cannot be made,
# that test skips and says why.
speculators-venv: $(STAMP)
	-$(BIN)/python scripts/speculators_venv.py

# --durations: the slowest, to keep the suite in budget. --reruns 1 --only-rerun '(?!)': a test
# whose worker dies of a native crash runs once more, and the summary counts it as a rerun; a
# test that fails (an error, an assertion) never reruns. (The crashes of 2026-12: workers out of
# memory maps, which tests/conftest.py now prevents; docs/development.md.)
test: $(STAMP) speculators-venv
	$(BIN)/python -m pytest -q -n 2 --durations=15 --reruns 1 --only-rerun '(?!)' tests

# Runs docs/guides/walkthrough.py once and every CLI's --help; Sphinx warnings fail the build.
docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

decode: $(STAMP)
	$(BIN)/python decode.py $(if $(CHECKPOINT),--checkpoint "$(CHECKPOINT)") --prompt "$(PROMPT)" $(ARGS)

# A JetFlow head for the embedded target (a few minutes on CPU); it ends with the decode.py
# command that drafts with it. Rerunning resumes, or says there is nothing left to do.
train: $(STAMP)
	@echo "make train: $(CONFIG) into $(WORKDIR); loading (the first lines take a few seconds)"
	$(BIN)/python train.py --config=$(CONFIG) --workdir=$(WORKDIR) $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache docs/_build
