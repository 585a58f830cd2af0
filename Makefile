# The README's two commands. Both create .venv when missing and install the package into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vitscale-installed
# the venv's tools first (deepspeed, ninja for DeepSpeed's JIT-built CPU op, console scripts)
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test install clean

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m launch.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf demo_out runs .pytest_cache
