# The README's two commands. Both create .venv when missing and install the package into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vitscale-installed
# the venv's tools first (deepspeed, ninja for DeepSpeed's JIT-built CPU op, console scripts)
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test test-gpu test-cluster cluster-packages install clean bench-gpu device-kit device-kit-nvidia

# A first install downloads torch, DeepSpeed and the rest (about 3 minutes): a line per stage, and
# pip's own lines (each package collected, its download's progress) instead of silence.
$(STAMP): setup.py
	@test -x $(PY) || { echo "make install: creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "make install: upgrading pip, setuptools and wheel in $(VENV)"
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	@echo "make install: installing vitscale with its test extras (torch, DeepSpeed, ...; about 3 min the first time)"
	$(PY) -m pip install --progress-bar on -e '.[test]'
	@echo "make install: building DeepSpeed's CPU communication op (without a GPU; once, under a minute)"
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	@touch $(STAMP)
	@echo "make install: done; $(VENV) is ready"

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m launch.demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not cluster and not gpu" -n 2 --dist loadfile --no-loadscope-reorder tests

# the checks only a GPU can make (bf16 fused attention, NCCL, nvJPEG); a CPU machine leaves them out
test-gpu: $(STAMP)
	@$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make test-gpu: no CUDA device here')"
	$(PY) -m pytest -q -m gpu tests

# the GPU figures on one GPU (planned for 8 min, ending within 9, on an H100): JSON + Markdown in BENCH_OUT
BENCH_OUT ?= runs/bench-gpu
bench-gpu: $(STAMP)
	$(PY) benchmarks/gpu_suite.py --output $(BENCH_OUT)

# the same on a GPU machine without network: wheels of what its image lacks, built here for its
# Python, sent there with the tree (benchmarks/README.md, benchmarks/device_run.sh)
DEVICE_KIT ?= device-kit
device-kit: $(STAMP)
	$(PY) benchmarks/device_kit.py --out $(DEVICE_KIT) --python-version 3.12

# DALI for that machine, in parts sent one per command (benchmarks/device_kit.py)
device-kit-nvidia: $(STAMP)
	$(PY) benchmarks/device_kit.py --nvidia --out device-kit-nvidia --python-version 3.12

# Real sshd + pdsh (two loopback "nodes") and a one-machine SLURM (munged, slurmctld, slurmd),
# all started by the tests' fixtures on high ports of 127.0.0.1/127.0.0.2 and stopped by PID.
# Needs root or sudo for the Debian packages and the daemons; under 15 minutes on 2 cores.
CLUSTER_PKGS := openssh-server pdsh slurm-wlm munge
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

cluster-packages:
	@missing=""; for p in $(CLUSTER_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

test-cluster: cluster-packages $(STAMP)
	$(SUDO) env PATH="$(PATH)" $(PY) -m pytest -q -m cluster tests/cluster

clean:
	rm -rf demo_out runs .pytest_cache
