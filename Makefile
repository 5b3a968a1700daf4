# Every target bootstraps .venv on first use; the stamp reinstalls only when pyproject.toml changes.
PYTHON ?= python3
TORCH ?= 2.13.0
VENV := .venv
comma := ,
PY := $(VENV)/bin/python


.PHONY: demo test bench bench-quick lint clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.stamp-%: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q "torch==$(TORCH)"
	$(PY) -m pip install -q -e ".[$(subst -,$(comma),$*)]"
	touch $@

demo: $(VENV)/.stamp-dev-llm
	$(VENV)/bin/gnnpar train gcn --dataset sbm --nprocs 4 --epochs 100 --out runs/demo --overwrite
	$(VENV)/bin/gnnpar report runs/demo

test: $(VENV)/.stamp-dev-llm
	$(PY) -m pytest --timeout=1200

bench: $(VENV)/.stamp-dev-llm-bench
	$(PY) benchmarks/run_all.py

bench-quick: $(VENV)/.stamp-dev-llm-bench
	$(PY) benchmarks/run_all.py --quick

lint: $(VENV)/.stamp-dev-llm
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
