#!/usr/bin/env bash
# One H200 call before the decode-step and FP8 work (issues 45, 46): the FP8 matmul forms inside a
# 32-layer program, llama-1b's batch-1 decode with XLA's command-buffer log and a profile, and
# `bench latency` for llama-1b and llama-8b. Everything lands in $OUT/decode_baseline.tgz.
#   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/decode_baseline.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching --compilation-cache-dir /tmp/cc)
timeout 190 python benchmarks/probes/fp8_forms.py --rows 1,16,128,2048 --repeats 20 --json "$work/fp8_forms.json" 2>&1 \
  | grep -vE "^W0|^I0|Warning" | tail -60
OUT=$work timeout 140 bash benchmarks/probes/graph_updates.sh llama-1b 1 2>&1 | tail -30
for m in llama-1b llama-8b; do
  bs=1,32; [ "$m" = llama-8b ] && bs=1
  timeout 150 python -m orca_jax.bench latency --model "$m" "${engine[@]}" --batch-size $bs --async-scheduling on \
    --num-iters 1 --num-iters-warmup 1 --decode-steps 30 --output-len 16 --result-dir "$work" \
    --result-filename "${m}_latency_before.json" 2>&1 | grep -E "^batch|Error|error" | head
done
tar czf "$OUT/decode_baseline.tgz" -C "$work" . && rm -rf "$work"
