#!/usr/bin/env bash
# One H200 call (issue 46): llama-8b's batch-1 and batch-32 decode in bf16, in FP8 with the untied LM head
# stored as e4m3 (the default), and in FP8 with the head kept in bf16 (--no-quantize-lm-head), all in this
# one call so the ratios share a machine. THROUGHPUT=1 adds the uniform trace for the two FP8 variants
# (about 2 more minutes). Everything lands in $OUT/fp8_head_h200.tgz.
#   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/fp8_head_h200.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching --compilation-cache-dir /tmp/cc)
quiet() { grep -E "^batch|tok/s|tokens/s|Error|error|Traceback" | grep -v "^W0" | head -12; }
lat() {  # NAME [flags]
  local name=$1; shift
  timeout 150 python -m orca_jax.bench latency --model llama-8b "${engine[@]}" --batch-size 1,32 --async-scheduling on \
    --num-iters 1 --num-iters-warmup 1 --decode-steps 30 --output-len 16 --result-dir "$work" \
    --result-filename "${name}_latency.json" "$@" 2>&1 | sed "s/^/$name /" | quiet
}
thr() {  # NAME [flags]
  local name=$1; shift
  timeout 120 python -m orca_jax.bench throughput --model llama-8b "${engine[@]}" --dataset-name uniform --num-runs 1 \
    --result-dir "$work" --result-filename "${name}_throughput.json" "$@" 2>&1 | sed "s/^/$name /" | quiet
}
lat llama-8b_bf16
lat llama-8b_fp8 -q fp8
lat llama-8b_fp8_head_bf16 -q fp8 --no-quantize-lm-head
if [ "${THROUGHPUT:-0}" = 1 ]; then
  thr llama-8b_fp8 -q fp8
  thr llama-8b_fp8_head_bf16 -q fp8 --no-quantize-lm-head
fi
python -m orca_jax.bench plan --model llama-8b --gpu-memory-gib 141 -q fp8 --num-prompts 50 2>&1 | grep "GPUs of"
python -m orca_jax.bench plan --model llama-8b --gpu-memory-gib 141 -q fp8 --no-quantize-lm-head --num-prompts 50 2>&1 \
  | grep "GPUs of"
tar czf "$OUT/fp8_head_h200.tgz" -C "$work" . && rm -rf "$work"
