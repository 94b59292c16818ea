#!/usr/bin/env bash
# `make gpu-check`, the device check in one command (docs/gpu.md). On the GPU machine it first
# makes sure every module the check needs imports: where one does not, it installs the carried
# wheels (.device/wheels, from `make device-wheels`) into /tmp/tandem-site, first on
# PYTHONPATH, leaving the machine's own torch and transformers alone, and checks again; a
# module still missing stops the run here, before anything else. Then it runs
# tests/device/gpu_check.py, teeing its output into $OUT (default gpu-check-out/). Without a
# GPU: the CPU dry run. Arguments go to gpu_check.py (--stages, --time-limit, --serve-args,
# --dry-run ...).
set -u
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# Everything the check imports: what the machine should have, then what the wheels carry.
MODULES="torch transformers safetensors numpy aiohttp jinja2 tokenizers tqdm prometheus_client msgspec zmq
xgrammar pydantic jsonschema referencing rpds attrs xxhash uvloop"
missing() {
  "$PYTHON" - $MODULES <<'PY'
import importlib, sys
bad = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # any failure to import is a missing module here
        bad.append(f"{name} ({type(exc).__name__}: {exc})"[:200])
print("\n".join(bad))
PY
}
gone=$(missing)
if [ -n "$gone" ]; then
  echo "gpu-check: not importable here: $(echo "$gone" | cut -d' ' -f1 | tr '\n' ' ')" >&2
  if ! ls .device/wheels/*.whl >/dev/null 2>&1; then
    echo "gpu-check: and no .device/wheels to install them from: run make device-wheels" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tandem-site .device/wheels/*.whl || exit 2
  export PYTHONPATH="/tmp/tandem-site${PYTHONPATH:+:$PYTHONPATH}"
  gone=$(missing)
  if [ -n "$gone" ]; then
    echo "gpu-check: still not importable after installing the carried wheels:" >&2
    echo "$gone" >&2
    exit 2
  fi
fi
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 TANDEM_CACHE="${TANDEM_CACHE:-$PWD/.device/cache}"
"$PYTHON" -m tests.device.gpu_check --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
