#!/usr/bin/env bash
# The GPU suite and the GPU tests on a GPU machine without network (benchmarks/README.md).
# First, where the registries are reachable: `make device-kit` (wheels of what the machine's image
# lacks, for its Python 3.12). Then on the GPU machine, with device-kit/ beside the tree, from the
# repository root, one part per command (each ends within 10 minutes):
#   bash benchmarks/device_run.sh train    # vit-train's own path, lever by lever (benchmarks/vit_train_gpu.py)
#   bash benchmarks/device_run.sh suite
#   bash benchmarks/device_run.sh tests
# DALI (`make device-kit-nvidia`, in parts) comes first, one part per short command, each sent
# with device-kit-nvidia/parts.sha256:
#   bash benchmarks/device_run.sh carry
# and is installed before the suite or the tests once every part is there.
# Results are written under $OUT: bench-gpu/suite.{json,md} (for benchmarks/results/), logs,
# nvidia-smi and pip state. On a GPU machine with its own environment `make bench-gpu` is the same suite.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: benchmarks/device_run.sh train|suite|tests|carry}
OUT=${OUT:-runs/device}
KIT=${KIT:-device-kit}
NVKIT=${NVKIT:-device-kit-nvidia}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ "$part" = carry ]; then  # a part of the DALI kit arrived: say which are here
  if [ ! -f "$NVKIT/parts.sha256" ]; then
    echo "device_run.sh: $NVKIT/parts.sha256 missing: carry it with each part" >&2
    exit 2
  fi
  ls -l "$NVKIT"
  "$PY" benchmarks/device_kit.py --join "$NVKIT" --out /tmp/device-kit-nvidia-check && rm -rf /tmp/device-kit-nvidia-check
  exit 0
fi
if [ ! -f "$KIT/requirements.txt" ]; then
  echo "device_run.sh: $KIT/requirements.txt missing: run \`make device-kit\` here and carry $KIT" >&2
  exit 2
fi
# installed into the machine's own Python, wheels only from the kit; what the image already has
# at a fitting version stays as it is
"$PY" -m pip install -q --no-index --find-links "$KIT" -r "$KIT/requirements.txt" 2>&1 | tail -5
if [ -f "$NVKIT/parts.sha256" ]; then  # DALI, once every part has been carried
  nv=$(mktemp -d)
  "$PY" benchmarks/device_kit.py --join "$NVKIT" --out "$nv" \
    && "$PY" -m pip install -q --no-index --find-links "$nv" -r "$nv/requirements.txt" 2>&1 | tail -5
  rm -rf "$nv"
fi
"$PY" -m pip check > "$OUT/pip-check.txt" 2>&1 || true
"$PY" - <<'EOF' | tee "$OUT/versions.txt"
import deepspeed, torch, torchvision, timm, webdataset, sys
print(f"python {sys.version.split()[0]} torch {torch.__version__} torchvision {torchvision.__version__} "
      f"deepspeed {deepspeed.__version__} timm {timm.__version__} webdataset {webdataset.__version__}; "
      f"cuda {torch.cuda.is_available()} {torch.cuda.get_device_name() if torch.cuda.is_available() else ''}")
EOF
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "$part" in
  train)  # ends within 500 s (8 min 20 s) of its start (benchmarks/vit_train_gpu.py)
    # the rows' logs and metrics go into one archive beside the JSON: few files come back from $OUT
    rows=$(mktemp -d)
    # shellcheck disable=SC2086  # TRAIN_ARGS=--smoke rehearses the whole script on a CPU machine
    "$PY" benchmarks/vit_train_gpu.py --output "$rows" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
    code=${PIPESTATUS[0]}
    cp "$rows/vit_train_gpu.json" "$OUT/" 2>/dev/null
    tar -czf "$OUT/vit-train-rows.tar.gz" -C "$rows" . && rm -rf "$rows"
    exit "$code" ;;
  suite)  # plans 8 minutes from its start and ends within 9 (benchmarks/gpu_suite.py)
    # shellcheck disable=SC2086  # SUITE_ARGS=--smoke rehearses the whole script on a CPU machine
    "$PY" benchmarks/gpu_suite.py --output "$OUT/bench-gpu" ${SUITE_ARGS:-} 2>&1 | tee "$OUT/suite.log"
    exit "${PIPESTATUS[0]}" ;;
  tests)  # the `gpu`-marked tests (make test-gpu; CPU machines leave them out)
    # shellcheck disable=SC2086  # PYTEST_ARGS: another selection (a rehearsal on CPU runs CPU tests)
    "$PY" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:--m gpu tests} 2>&1 | tee "$OUT/gpu-tests.log"
    exit "${PIPESTATUS[0]}" ;;
  *) echo "device_run.sh: unknown part '$part' (train, suite, tests or carry)" >&2; exit 2 ;;
esac
