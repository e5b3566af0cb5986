#!/usr/bin/env bash
# Every (tp, pp) layout of LAYOUTS on one machine, side by side with (1, 1): `bench latency` (batch 1, 8, 32
# at context 512) and `bench throughput` (the ORCA trace: 512 requests, prompts U(32, 512), outputs
# U(1, 128), EOS ignored), llama-8b random bf16, 256 sequences / 8,192 tokens, prefix caching off, one
# compilation cache shared by the two benches of a layout.
#   benchmarks/probes/mesh_layouts.sh OUT_DIR [MODEL] ["1x1 2x1 1x2"]
set -u
out=${1:?OUT_DIR}; model=${2:-llama-8b}; layouts=${3:-1x1 2x1 1x2}
mkdir -p "$out"
engine=(--model "$model" --max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching
        --compilation-cache-dir /tmp/orca_jax_cache)
for layout in $layouts; do
  tp=${layout%x*}; pp=${layout#*x}
  echo "== (tp, pp) = ($tp, $pp)"
  python3 -m orca_jax.bench latency "${engine[@]}" -tp "$tp" -pp "$pp" --batch-size 1,8,32 --decode-steps 30 \
    --num-iters 2 --result-dir "$out" --result-filename "${model}_tp${tp}_pp${pp}_latency.json" 2>&1 \
    | grep -E "^batch|Error|error" | head -20
  python3 -m orca_jax.bench throughput "${engine[@]}" -tp "$tp" -pp "$pp" --dataset-name uniform --num-runs 2 \
    --result-dir "$out" --result-filename "${model}_tp${tp}_pp${pp}_throughput.json" 2>&1 \
    | grep -E "tok/s|tokens/s|Error|error" | head -10
done
