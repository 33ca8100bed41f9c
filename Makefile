# `make demo` and `make test` are the two commands a newcomer types (README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A CPU machine gets the CPU wheel of torch; a GPU machine keeps the torch it has.
TORCH ?= torch==2.13.0

.PHONY: install demo test clean
install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps megatron-bridge==0.3.1
	touch $(STAMP)

demo: install
	$(BIN)/python -m mfsdp_kit.demo

test: install
	$(BIN)/python -m pytest -q tests $(if $(wildcard notebooks/*.ipynb),&& $(BIN)/python -m pytest -q --nbval-lax -p no:cacheprovider notebooks/)

clean:
	rm -rf $(VENV) runs
