# `make demo` and `make test` create .venv when it is missing; everything is installed with
# constraints.txt so that torch stays on the CPU build (an unpinned torch pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-all figures clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	@if [ -f sweeps/quickstart.yaml ]; then $(BIN)/emapg sweep sweeps/quickstart.yaml; \
	else echo "The quickstart sweep is not built yet (issue: sweeps); run 'make test' meanwhile."; fi

test: $(STAMP)
	$(BIN)/python -m pytest

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu and not verl"

figures: $(STAMP)
	$(BIN)/emapg figures --out outputs/figures

clean:
	rm -rf $(VENV) outputs
