# `make demo` and `make test` are the two commands a newcomer types (README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A CPU machine gets the CPU wheel of torch; a GPU machine keeps the torch it has.
TORCH ?= torch==2.13.0

.PHONY: install demo test test-deps test-portable-parity test-portable-folder check lab clean mpi hooks docs
install: $(STAMP) hooks

# The repository's git hooks (scripts/hooks; commit-msg: a subject of at most 72 characters), set only where
# this folder is a git clone's top (not a tarball, CI's copy without .git, or a folder inside another repository)
# and core.hooksPath is not set already.
hooks:
	@if command -v git >/dev/null && [ "$$(git rev-parse --show-toplevel 2>/dev/null)" = "$$(pwd -P)" ] \
	  && [ -z "$$(git config core.hooksPath)" ]; then \
	  git config core.hooksPath scripts/hooks && echo "git hooks: core.hooksPath = scripts/hooks"; fi

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps megatron-bridge==0.3.1
	touch $(STAMP)

# JupyterLab (the `lab` extra) on notebooks/, 127.0.0.1 + token; prints the URL and the SSH tunnel line.
LAB_STAMP := $(VENV)/.lab-installed
$(LAB_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[test,lab]"
	touch $(LAB_STAMP)

lab: $(LAB_STAMP)
	$(BIN)/python -m mfsdp_kit.notebook.lab

demo: install
	$(BIN)/python -m mfsdp_kit.demo

# Then the parity checks (tests marked `parity` and the DDP-vs-FSDP notebook) once more on the
# portable ATen kernels: a comparison that only holds for this CPU's SIMD kernels fails here, not on
# a user's machine. Inductor's C++ cache is per capability (a cache built natively breaks the build).
# One of each kind of comparison (PORTABLE_PARITY): dense DDP vs FSDP over 20 steps and TP 2 vs 1
# (train, distributed), packed vs padded rows (train), MoE's expert layouts (models). LoRA's and HSDP's
# parity tests compare the same dense reductions in other groupings: they run natively only.
PORTABLE := ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/$(VENV)/inductor-default
PORTABLE_PARITY := tests/train tests/distributed tests/models/test_moe.py
# With an MPI on PATH (CI installs Debian's OpenMPI), mpi4py too, so tests/notebook/test_cluster_mpi.py runs, not skips.
mpi: install
	@if command -v mpiexec >/dev/null && ! $(BIN)/python -c "import mpi4py" 2>/dev/null; then \
	  $(BIN)/python -m pip install -q -e ".[mpi]"; fi

# make test's parts, each timed into runs/test_times.tsv (scripts/timed); .ci/run prints the table at its end.
TIMED := scripts/timed
# The browser check (tests/test_ui_live.py) drives the system chromium with playwright (the `ui` extra).
UI_STAMP := $(VENV)/.ui-installed
$(UI_STAMP): $(LAB_STAMP)
	$(BIN)/python -m pip install -q -e ".[test,lab,ui]"
	touch $(UI_STAMP)

test-deps: install $(LAB_STAMP) $(UI_STAMP) mpi

# pytest over tests/ and nbval over notebooks/ in one session on TEST_JOBS workers (pytest-xdist): a test file or a
# notebook stays on one worker (--dist loadfile), so a module's fixtures and a notebook's kernel are made once.
# Two workers fill a 2-core machine: one alone left ~30 % of it idle (engines starting, kernels waiting on each
# other), and many tests already run 2 ranks, so more workers only contend.
TEST_JOBS ?= 2
# Where chromium is, tests/test_ui_live.py has run 00_cluster, 02_sft and widgets_demo natively in JupyterLab and
# checked what nbval does here (every cell ran, no error, no warning shown) and more: not again.
UI_RAN := $(if $(shell command -v chromium || command -v chromium-browser),--deselect notebooks/00_cluster.ipynb \
  --deselect notebooks/02_sft.ipynb --deselect notebooks/widgets_demo.ipynb)

test: test-deps
	rm -f runs/test_times.tsv
	$(TIMED) "pytest+notebooks" $(BIN)/python -m pytest -q -rs --durations=60 -n $(TEST_JOBS) --dist loadfile \
	  -p no:cacheprovider --nbval-lax tests $(if $(wildcard notebooks/*.ipynb),notebooks/ $(UI_RAN))
	$(MAKE) --no-print-directory -j2 test-portable-parity test-portable-folder

# make test's two passes on the portable ATen kernels, side by side (each ~1 core: 2 ranks that wait on each other).
test-portable-parity:
	$(TIMED) "portable parity" env $(PORTABLE) $(BIN)/python -m pytest -q -rs -m parity $(PORTABLE_PARITY)

# a folder the kit did not make (transformers' Llama, a Llama 3 chat template, no pad token): tests/user_folder.py;
# on the portable kernels too, so its 02_sft is also the DDP-vs-FSDP notebook's portable run (the same
# compare_curves check as on the kit's tiny model; that model's learning-pace checks run natively above)
test-portable-folder:
	$(TIMED) "portable folder" sh -c '$(BIN)/python -m tests.user_folder runs/user_llama3 --style llama3 >/dev/null && \
	  MFSDP_MODEL=$(CURDIR)/runs/user_llama3 env $(PORTABLE) $(BIN)/python -m pytest -q -rs --nbval-lax \
	  -p no:cacheprovider notebooks/02_sft.ipynb notebooks/05_grpo.ipynb'

# The quick loop for contributors (under 3 min on 2 cores): every test that starts no process
# (tests/conftest.py marks the others `slow`), then one 2-rank job: DDP vs Megatron-FSDP losses and sharding.
check: install
	$(BIN)/python -m pytest -q -rs -m "not slow" tests
	$(BIN)/python -m pytest -q -rs tests/distributed/test_engine_dist.py -k "fsdp_matches_ddp or shards"

# The release set's figures (docs/results/h200x1/, from `SECTIONS=release bash scripts/gpu_check.sh`) into README.md
# and the top of docs/benchmarks.md, and the GRPO split figure (scripts/make_docs.py; docs/gpu.md).
docs: install
	$(BIN)/python scripts/make_docs.py

clean:
	rm -rf $(VENV) runs
