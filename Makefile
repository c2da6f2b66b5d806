# Two entry points for users: `make demo` and `make test`. Both build the venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-done

.PHONY: setup demo test clean

setup: $(STAMP)

# torch first and pinned (a plain `torch` would pull a multi-GB CUDA build); CrypTen with
# --no-deps because its declared requirements are broken under torch 2.13 (see README).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps crypten==0.4.1
	$(PIP) install --quiet -e '.[dev,scale]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/starfish demo

# two workers, each taking whole modules (the 2PC sessions a worker shares stay in one process):
# 550 s on 2 cores on a fresh clone at e1d6975 (510 s at 600e793); three workers took 697 s where two took 654 s at
# 5ebacc2 (earlier: 735 s with two, 684 s with three and 771 s with four); the heaviest modules
# first (tests/conftest.py)
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

clean:
	rm -rf $(VENV)
