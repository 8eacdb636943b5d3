# The two set-up commands of the README: `make demo` and `make test`.
# Each creates the virtual environment and installs what it needs the first time.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.asyncckpt-installed

.PHONY: demo test lint bench bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[tf,jax,storage,clients,dev]"
	# orbit (tests/clients): only its own code; its wheel's pins would replace TensorFlow.
	$(BIN)/python -m pip install --quiet --no-deps "tf-models-official>=2.20,<2.21"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m examples.demo

test: $(STAMP)
	$(BIN)/ruff check asyncckpt tests benchmarks examples
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check asyncckpt tests benchmarks examples

# The benchmarks (benchmarks/, not part of the package): `python -m benchmarks --help`.
bench: $(STAMP)
	$(BIN)/python -m benchmarks

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks --quick

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
