# Every target bootstraps .venv itself: a fresh machine needs only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/demo

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,plot]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	rm -rf $(WORKDIR)
	$(VENV)/bin/treetools train --workdir $(WORKDIR) --cpu-devices 4
	$(VENV)/bin/treetools inspect $(WORKDIR)/checkpoints

test: $(STAMP)
	$(PY) -m pytest -q tests benchmarks/test_smoke.py

bench: $(STAMP)
	$(PY) -m pytest -q -s benchmarks --benchmark-enable --benchmark-columns=min,mean,rounds -p no:randomly

clean:
	rm -rf $(VENV) runs .pytest_cache .benchmarks
