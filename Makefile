# Every target bootstraps .venv on first use; the stamp reinstalls only when pyproject.toml changes.
PYTHON ?= python3
TORCH ?= 2.13.0
VENV := .venv
comma := ,
PY := $(VENV)/bin/python
DEMO_EPOCHS ?= 100


.PHONY: demo test mutants coverage bench bench-quick lint clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.stamp-%: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q "torch==$(TORCH)"
	$(PY) -m pip install -q -e ".[$(subst -,$(comma),$*)]"
	touch $@

demo: $(VENV)/.stamp-dev-llm
	$(VENV)/bin/gnnpar train gcn --dataset sbm --nprocs 4 --epochs $(DEMO_EPOCHS) --out runs/demo --overwrite
	$(VENV)/bin/gnnpar report runs/demo

# The dgl extra makes the DGL cross-checks run instead of skipping.
# Two workers (TEST_WORKERS=0 runs in one process): many tests leave a core idle (one
# process, or ranks waiting for each other); a module's tests stay on one worker.
TEST_WORKERS ?= 2
test: $(VENV)/.stamp-dev-llm-dgl
	$(PY) -m pytest --timeout=1200 -n $(TEST_WORKERS) --dist loadgroup

# Not part of `make test`: apply each curated one-line bug in tests/mutants/mutants.toml to a
# copy of the tree and run the test files of the module it touches (docs/testing.md).
mutants: $(VENV)/.stamp-dev-llm-dgl
	$(PY) tests/mutants/run.py

# Line coverage of the whole suite (ranks included) and the public functions never executed.
coverage: $(VENV)/.stamp-dev-llm-dgl
	$(PY) tests/coverage_report/run.py

bench: $(VENV)/.stamp-dev-llm-bench
	$(PY) benchmarks/run_all.py

bench-quick: $(VENV)/.stamp-dev-llm-bench
	$(PY) benchmarks/run_all.py --quick

lint: $(VENV)/.stamp-dev-llm
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
