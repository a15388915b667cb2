# Every target bootstraps .venv itself: a fresh machine needs only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two stamps: `make demo` installs what the demo needs (treetools and its plot extra, for `treetools plot` after
# it); `make test` and `make bench` add the test extras (pytest, the object-store servers, the Keras/Equinox
# writers, torch and transformers for the reference model's logits, gcsfs/s3fs) on top.
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
DEMO_EXTRAS := plot
TEST_EXTRAS := test,test-formats,test-hf,plot,remote,keras,tensorboard,af3,wandb
WORKDIR ?= runs/demo

.PHONY: demo test bench venv clean

$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip uninstall -q -y treetools 2>/dev/null || true  # this project's name before jax-treetools (issue 39)
	$(PY) -m pip install -q -c constraints.txt -e '.[$(DEMO_EXTRAS)]'
	touch $@

$(TEST_STAMP): $(DEMO_STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[$(TEST_EXTRAS)]'
	touch $@

venv: $(TEST_STAMP)

# An existing run in WORKDIR is kept: the trainer resumes it up to its default --steps (200), or leaves it as it
# is when it is there already (a run extended with --steps 400). A fresh demo: make demo WORKDIR=runs/demo2.
demo: $(DEMO_STAMP)
	@if [ -d $(WORKDIR)/checkpoints ]; then \
	  echo "make demo: $(WORKDIR) holds a run already; keeping it (continued up to step 200 if it is short of it)." \
	       "For a fresh run: make demo WORKDIR=runs/demo2, or delete $(WORKDIR) first."; \
	fi
	$(VENV)/bin/treetools train --workdir $(WORKDIR) --cpu-devices 4
	$(VENV)/bin/treetools inspect $(WORKDIR)/checkpoints

# One worker per core (at most 4), a test file per worker at a time: its module fixtures (trained runs, written
# checkpoints) are built once.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile tests benchmarks/test_smoke.py

# One process per suite: Orbax/TensorStore threads left by one suite must not share the cores with the next.
bench: $(TEST_STAMP)
	set -e; for suite in benchmarks/test_*_bench.py; do \
	  $(PY) -m pytest -q -s $$suite --benchmark-enable --benchmark-columns=min,median,rounds; \
	done

clean:
	rm -rf $(VENV) runs .pytest_cache .benchmarks
