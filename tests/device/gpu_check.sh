#!/usr/bin/env bash
# `make gpu-check`, the device check in one command (docs/gpu.md). On the GPU machine it first
# installs the carried wheels (.device/wheels, from `make device-wheels`) into /tmp/tandem-site,
# leaving the machine's own torch and transformers alone, then runs tests/device/gpu_check.py,
# teeing its output into $OUT (default gpu-check-out/). Without a GPU: the CPU dry run.
# Arguments go to gpu_check.py (--stages, --time-limit, --serve-args, --dry-run ...).
set -u
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import msgspec, zmq" 2>/dev/null; then
  if ! ls .device/wheels/*.whl >/dev/null 2>&1; then
    echo "gpu-check: msgspec/pyzmq missing and no .device/wheels: run make device-wheels" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tandem-site .device/wheels/*.whl || exit 2
  export PYTHONPATH="/tmp/tandem-site${PYTHONPATH:+:$PYTHONPATH}"
fi
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 TANDEM_CACHE="${TANDEM_CACHE:-$PWD/.device/cache}"
"$PYTHON" -m tests.device.gpu_check --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
