#!/usr/bin/env bash
# One H200 call for the layer kernel and the decode programs (issue 45): correctness on the GPU (layer_kernels_check.py), then
# PART=1: kernel-level profiles of llama-1b and llama-8b batch-1 decode and `bench latency` of llama-1b,
# PART=2: `bench latency` of llama-8b and `bench throughput` (ORCA trace) of both; each with the kernels
# and decode programs (--attention-backend pallas) and without (pallas-attention: XLA's ops around the same
# attention, two attention passes in every bucket). FP8_CHECK=1 adds the check with FP8 KV pages.
# PART=3: issue 46's FP8 against bf16 (latency, the ORCA trace, the long-context trace) with these kernels.
# Everything lands in $OUT/layer_kernels_h200.tgz.
#   OUT=DIR ORCA_JAX_COMMIT=SHA PART=1|2|3 benchmarks/probes/layer_kernels_h200.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching --compilation-cache-dir /tmp/cc)
quiet() { grep -E " batch|tok/s|tokens/s|Error|error|Traceback" | grep -v "^W0" | head -12; }
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
if [ "${PART:-1}" = 1 ]; then
  timeout 150 python benchmarks/probes/layer_kernels_check.py --model llama-1b --dtype float32 --out "$work" 2>&1 \
    | grep -E "^\{|Error|Traceback|error:" | cut -c1-900
  if [ "${FP8_CHECK:-0}" = 1 ]; then
    timeout 120 python benchmarks/probes/layer_kernels_check.py --model llama-1b --dtype bfloat16 --kv-cache-dtype fp8 \
      --out "$work" 2>&1 | grep -E "^\{|Error|Traceback|error:" | cut -c1-900
  fi
  # Each pair without the change first: the first run on a fresh machine measured a slower host.
  for spec in "llama-1b pallas-attention" "llama-1b pallas" "llama-8b pallas-attention" "llama-8b pallas"; do
    set -- $spec
    timeout 100 python benchmarks/probes/mesh_profile.py --model "$1" -tp 1 -pp 1 --batch-size 1 \
      --attention-backend "$2" --out "$work" 2>&1 | grep -E "^\{|Error|Traceback" | cut -c1-400
  done
  python benchmarks/probes/mesh_trace_summary.py "$work"/*.trace.json.gz > "$work/trace_summary.json"
  python - "$work/trace_summary.json" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1])):
    print("==", t["trace"], "host ms/forward", round(t["forward_host_ms_per_call_per_device"], 3))
    for dev, d in t["device"].items():
        print(" ", {k: (round(v["kernels_per_call"], 1), round(v["ms_per_call"], 3))
                    for k, v in d.items() if k != "top_kernels"})
        for k in d["top_kernels"][:14]:
            print("    %7.1f us %6.1f x  %s" % (k["us_per_call"], k["per_call"], k["kernel"][:70]))
PY
  lat llama-1b_off llama-1b 1,8,32 --attention-backend pallas-attention
  lat llama-1b llama-1b 1,8,32 --attention-backend pallas
fi
if [ "${PART:-1}" = 2 ]; then
  lat llama-1b_rep llama-1b 1,8,32 --attention-backend pallas  # llama-1b is host-bound: a second pair, reversed
  lat llama-1b_off_rep llama-1b 1,8,32 --attention-backend pallas-attention
  lat llama-8b_off llama-8b 1,8,32 --attention-backend pallas-attention
  lat llama-8b llama-8b 1,8,32 --attention-backend pallas
  thr llama-1b_off llama-1b --attention-backend pallas-attention
  thr llama-1b llama-1b --attention-backend pallas
  thr llama-8b_off llama-8b --attention-backend pallas-attention
  thr llama-8b llama-8b --attention-backend pallas
fi
if [ "${PART:-1}" = 3 ]; then  # issue 46 with this round's kernels: FP8 against bf16, same call
  lat llama-8b_bf16 llama-8b 1,32
  lat llama-8b_fp8 llama-8b 1,32 -q fp8
  thr llama-8b_bf16 llama-8b
  thr llama-8b_fp8 llama-8b -q fp8
  long=(--max-num-batched-tokens 8192 --no-enable-prefix-caching --dataset-name uniform --uniform-input-range 7680:7936
        --uniform-output-range 256:256 --num-prompts 64 --max-num-seqs 64 --num-runs 1 --result-dir "$work")
  for spec in "bf16" "fp8_kvfp8 -q fp8 --kv-cache-dtype fp8"; do
    set -- $spec
    timeout 150 python -m orca_jax.bench throughput --model llama-8b "${long[@]}" --compilation-cache-dir /tmp/cc_$1 \
      --result-filename "llama-8b_long_$1.json" "${@:2}" 2>&1 | sed "s/^/long_$1 /" | quiet
  done
fi
tar czf "$OUT/layer_kernels_h200.tgz" -C "$work" . && rm -rf "$work"
