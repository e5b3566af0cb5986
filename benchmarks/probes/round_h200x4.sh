#!/usr/bin/env bash
# One 4-H200 call, four lanes side by side (issues 45 and 46), every ratio within one lane's GPU:
#   A, GPU 0: llama-1b bench latency (batch 1, 32) and the ORCA trace, with the engine's XLA options
#      (SKIP_TEMP: the forward's CUDA graph replayed unchanged) and without (ORCA_JAX_XLA_DEFAULTS=0);
#      then llama-8b's decode-heavy long-context trace (64 prompts of ~8k tokens, 256 generated),
#      bf16 against FP8 weights + FP8 KV pages.
#   B, GPU 1: llama-8b bf16 and FP8 weights: bench latency (batch 1, 32), the ORCA trace; bf16 without
#      the options too.
#   C, GPUs 2-3: GPT-3 175B in FP8 at (2, 1): bench latency (batch 1, against its FP8 weight-read
#      bound), then bench sweep at ORCA's Figure 10 rates.
# Everything lands in $OUT/round_h200x4.tgz.   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/round_h200x4.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"/{a,b,c}
nvidia-smi -L
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching)
lat() {  # DIR NAME MODEL BATCHES [flags]
  local d=$1 name=$2 m=$3 bs=$4; shift 4
  python -m orca_jax.bench latency --model "$m" "${engine[@]}" --compilation-cache-dir /tmp/cc_$d --batch-size "$bs" \
    --num-iters 1 --num-iters-warmup 1 --decode-steps 30 --output-len 16 --result-dir "$work/$d" \
    --result-filename "${name}_latency.json" "$@" > "$work/$d/${name}_latency.log" 2>&1
  echo "$name: $(grep -E '^batch' "$work/$d/${name}_latency.log" | tr '\n' ' ')$(grep -m1 -E 'Error' "$work/$d/${name}_latency.log")"
}
thr() {  # DIR NAME MODEL [flags]
  local d=$1 name=$2 m=$3; shift 3
  python -m orca_jax.bench throughput --model "$m" "${engine[@]}" --compilation-cache-dir /tmp/cc_$d \
    --dataset-name uniform --num-runs 1 --result-dir "$work/$d" --result-filename "${name}_throughput.json" "$@" \
    > "$work/$d/${name}_throughput.log" 2>&1
  echo "$name: $(grep -E 'tok/s' "$work/$d/${name}_throughput.log" | tail -1)$(grep -m1 -E 'Error' "$work/$d/${name}_throughput.log")"
}
lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  lat a llama-1b llama-1b 1,32
  ORCA_JAX_XLA_DEFAULTS=0 lat a llama-1b_xla_defaults llama-1b 1,32
  thr a llama-1b llama-1b
  ORCA_JAX_XLA_DEFAULTS=0 thr a llama-1b_xla_defaults llama-1b
  long=(--dataset-name uniform --uniform-input-range 7936:8192 --uniform-output-range 256:256 --num-prompts 64
        --max-num-seqs 64 --max-model-len 8448 --num-runs 1)
  for v in "bf16:" "fp8_kvfp8:-q fp8 --kv-cache-dtype fp8"; do
    name=llama-8b_long_${v%%:*}
    python -m orca_jax.bench throughput --model llama-8b --max-num-batched-tokens 8192 --no-enable-prefix-caching \
      --compilation-cache-dir /tmp/cc_long "${long[@]}" ${v#*:} --result-dir "$work/a" \
      --result-filename "$name.json" > "$work/a/$name.log" 2>&1
    echo "$name: $(grep -E 'tok/s' "$work/a/$name.log" | tail -1)$(grep -m1 -E 'Error' "$work/a/$name.log")"
  done
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=1
  lat b llama-8b llama-8b 1,32
  lat b llama-8b_fp8 llama-8b 1,32 -q fp8
  thr b llama-8b llama-8b
  thr b llama-8b_fp8 llama-8b -q fp8
  ORCA_JAX_XLA_DEFAULTS=0 thr b llama-8b_xla_defaults llama-8b
  ORCA_JAX_XLA_DEFAULTS=0 lat b llama-8b_xla_defaults llama-8b 1
}
lane_c() {
  export CUDA_VISIBLE_DEVICES=2,3 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
  big=(--model gpt3-175b -q fp8 -tp 2 --max-num-seqs 128 --max-num-batched-tokens 2048 --no-enable-prefix-caching
       --compilation-cache-dir /tmp/cc_c)
  python -m orca_jax.bench latency "${big[@]}" --batch-size 1,8 --num-iters 1 --num-iters-warmup 0 --decode-steps 20 \
    --output-len 8 --result-dir "$work/c" --result-filename gpt3-175b_fp8_tp2_latency.json > "$work/c/latency.log" 2>&1
  echo "gpt3-175b fp8 (2,1): $(grep -E '^batch|GiB|KV pages' "$work/c/latency.log" | tr '\n' ' ')$(grep -m1 Error "$work/c/latency.log")"
  python -m orca_jax.bench sweep "${big[@]}" --scheduler orca --request-rate 4,6.81,8.5 --min-point-prompts 32 \
    --point-seconds 8 --result-dir "$work/c" --result-filename gpt3-175b_fp8_tp2_sweep.json > "$work/c/sweep.log" 2>&1
  echo "gpt3-175b fp8 (2,1) sweep: $(grep -iE 'req/s|ms/token' "$work/c/sweep.log" | tail -6 | tr '\n' ' ')$(grep -m1 Error "$work/c/sweep.log")"
}
( sleep 545; pkill -f "orca_jax.bench" ) &  # every lane stops in time for the results to come back
watchdog=$!
lane_a > "$work/lane_a.txt" 2>&1 & a=$!
lane_b > "$work/lane_b.txt" 2>&1 & b=$!
lane_c > "$work/lane_c.txt" 2>&1 & c=$!
wait $a $b $c
kill $watchdog 2>/dev/null
cat "$work"/lane_*.txt
for f in "$work"/*/*.log; do gzip -f "$f"; done
tar czf "$OUT/round_h200x4.tgz" -C "$work" . && rm -rf "$work"
