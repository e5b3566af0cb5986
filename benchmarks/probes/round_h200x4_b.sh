#!/usr/bin/env bash
# The second 4-H200 call (issues 45, 46). Phase 1, nothing else running (llama-1b is host-bound, and
# the first call's lanes running beside it slowed its host): llama-1b bench latency (batch 1, 32) and
# the ORCA trace, with the engine's XLA options and with XLA's defaults. Phase 2, side by side:
# llama-8b's decode-heavy long-context trace (64 prompts of 7,680-7,936 tokens, 256 generated each) in
# bf16 on GPU 0 and with FP8 weights + FP8 KV on GPU 1; GPT-3 175B FP8 at (2, 1) on GPUs 2-3, bench
# sweep at 10 and 12 req/s offered (Figure 10's 6.81 completed is the target).
#   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/round_h200x4_b.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching --compilation-cache-dir /tmp/cc)
run() {  # NAME LOGLINE_PATTERN COMMAND...: runs it, prints its result lines
  local name=$1 pattern=$2; shift 2
  "$@" --result-dir "$work" --result-filename "$name.json" > "$work/$name.log" 2>&1
  echo "$name: $(grep -E "$pattern" "$work/$name.log" | tr '\n' ' ')$(grep -m1 -E 'Error' "$work/$name.log")"
}
export CUDA_VISIBLE_DEVICES=0
for v in on off; do
  [ $v = off ] && export ORCA_JAX_XLA_DEFAULTS=0
  run llama-1b_${v}_latency '^batch' python -m orca_jax.bench latency --model llama-1b "${engine[@]}" --batch-size 1,32 \
    --num-iters 1 --num-iters-warmup 1 --decode-steps 40 --output-len 16
  run llama-1b_${v}_throughput 'tok/s' python -m orca_jax.bench throughput --model llama-1b "${engine[@]}" \
    --dataset-name uniform --num-runs 2
done
unset ORCA_JAX_XLA_DEFAULTS
long=(--model llama-8b --max-num-batched-tokens 8192 --no-enable-prefix-caching --dataset-name uniform
      --uniform-input-range 7680:7936 --uniform-output-range 256:256 --num-prompts 64 --max-num-seqs 64 --num-runs 1)
( CUDA_VISIBLE_DEVICES=0 run llama-8b_long_bf16 'tok/s' python -m orca_jax.bench throughput "${long[@]}" \
    --compilation-cache-dir /tmp/cc0 ) &
( CUDA_VISIBLE_DEVICES=1 run llama-8b_long_fp8_kvfp8 'tok/s' python -m orca_jax.bench throughput "${long[@]}" \
    -q fp8 --kv-cache-dtype fp8 --compilation-cache-dir /tmp/cc1 ) &
( CUDA_VISIBLE_DEVICES=2,3 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 run gpt3-175b_fp8_tp2_sweep 'req/s' \
    python -m orca_jax.bench sweep --model gpt3-175b -q fp8 -tp 2 --max-num-seqs 128 --max-num-batched-tokens 2048 \
    --no-enable-prefix-caching --compilation-cache-dir /tmp/cc23 --scheduler orca --request-rate 10,12 \
    --min-point-prompts 64 --point-seconds 10 ) &
( sleep 290; pkill -f orca_jax.bench ) & watchdog=$!
wait %1 %2 %3
kill $watchdog 2>/dev/null
for f in "$work"/*.log; do gzip -f "$f"; done
tar czf "$OUT/round_h200x4_b.tgz" -C "$work" . && rm -rf "$work"
