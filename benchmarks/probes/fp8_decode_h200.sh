#!/usr/bin/env bash
# One H200 call (issues 45, 46): the FP8 matmul forms (second round: the kernel's bit conversion and
# narrower tiles), llama-1b's batch-1 decode with XLA's command-buffer log and a profile, and llama-8b
# bf16 against FP8 weights (bench latency batch 1 and 32, the ORCA trace), llama-1b's latency.
# Everything lands in $OUT/fp8_decode_h200.tgz.
#   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/fp8_decode_h200.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching --compilation-cache-dir /tmp/cc)
quiet() { grep -E "^batch|tok/s|tokens/s|Error|error|Traceback" | grep -v "^W0" | head -12; }
timeout 100 python benchmarks/probes/fp8_forms.py --rows 1,16,128 --repeats 20 --json "$work/fp8_forms_2.json" 2>&1 \
  | grep -E "M=" | grep -vE "^(bf16|xla_w8a8_kn)" 
OUT=$work timeout 110 bash benchmarks/probes/graph_updates.sh llama-1b 1 2>&1 | tail -22
lat() {  # NAME MODEL BATCHES [flags]
  local name=$1 m=$2 bs=$3; shift 3
  timeout 150 python -m orca_jax.bench latency --model "$m" "${engine[@]}" --batch-size "$bs" --async-scheduling on \
    --num-iters 1 --num-iters-warmup 1 --decode-steps 30 --output-len 16 --result-dir "$work" \
    --result-filename "${name}_latency.json" "$@" 2>&1 | sed "s/^/$name /" | quiet
}
thr() {  # NAME MODEL [flags]
  local name=$1 m=$2; shift 2
  timeout 120 python -m orca_jax.bench throughput --model "$m" "${engine[@]}" --dataset-name uniform --num-runs 1 \
    --result-dir "$work" --result-filename "${name}_throughput.json" "$@" 2>&1 | sed "s/^/$name /" | quiet
}
lat llama-8b_bf16 llama-8b 1,32
lat llama-8b_fp8 llama-8b 1,32 -q fp8
thr llama-8b_bf16 llama-8b
thr llama-8b_fp8 llama-8b -q fp8
lat llama-1b_bf16 llama-1b 1,32
tar czf "$OUT/fp8_decode_h200.tgz" -C "$work" . && rm -rf "$work"
