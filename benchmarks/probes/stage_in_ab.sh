#!/usr/bin/env bash
# One H200 call (issue 45): the batch's inputs staged by the forward program itself (the default)
# against a stage-in program of their own before it (ORCA_JAX_STAGE_IN=program), side by side:
# mesh_profile's engine steps and replays (llama-1b batch 1 and 32, llama-8b batch 1), `bench latency`
# (llama-1b batch 1, 8, 32; llama-8b batch 1, 32) and `bench throughput` (llama-1b, the ORCA trace).
# Everything lands in $OUT/stage_in_ab.tgz.   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/stage_in_ab.sh
# It measured commit 6a7adff, whose switch ORCA_JAX_STAGE_IN was reverted after it: staging in the
# forward cost more than the stage-in program's launch saved (benchmarks/results/h200/notes.md).
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching)
profile() {  # MODE MODEL BATCH
  ORCA_JAX_STAGE_IN=$1 timeout 100 python benchmarks/probes/mesh_profile.py --model "$2" -tp 1 -pp 1 --batch-size "$3" \
    --profile-steps 0 --steps 40 --out "$work/$1" 2>&1 | grep -E "^\{|Error|Traceback" | python -c "import json,sys
for line in sys.stdin:
    if not line.startswith('{'): print(line.rstrip()); continue
    r = json.loads(line); print('$1', '$2', 'b$3', 'ms/step %.3f' % r['ms_per_step'], 'host/it %.3f' % r['host_ms_per_iteration'],
          'dispatch %.3f' % r['dispatch_ms'], 'replay fwd host/device %.3f/%.3f' % tuple(r['replay_forward_ms']),
          'execute %.3f/%.3f' % tuple(r['replay_execute_ms']))"
}
lat() {  # MODE MODEL BATCHES
  ORCA_JAX_STAGE_IN=$1 timeout 150 python -m orca_jax.bench latency --model "$2" "${engine[@]}" --compilation-cache-dir /tmp/cc \
    --batch-size "$3" --async-scheduling on --num-iters 1 --num-iters-warmup 1 --decode-steps 30 --output-len 16 \
    --result-dir "$work" --result-filename "$2_stage_in_$1_latency.json" > "$work/$2_$1_latency.log" 2>&1
  python -c "import json
for r in json.load(open('$work/$2_stage_in_$1_latency.json'))['rows']:
    print('$1 $2 latency batch', r['batch_size'], 'ms/it %.3f' % r['ms_per_iteration'], 'device busy %.3f' % r['device_busy_ms'])" \
    || tail -5 "$work/$2_$1_latency.log"
}
thr() {  # MODE MODEL
  ORCA_JAX_STAGE_IN=$1 timeout 120 python -m orca_jax.bench throughput --model "$2" "${engine[@]}" --compilation-cache-dir /tmp/cc \
    --dataset-name uniform --num-runs 1 --result-dir "$work" --result-filename "$2_stage_in_$1_throughput.json" \
    > "$work/$2_$1_throughput.log" 2>&1
  echo "$1 $2 $(grep -E 'tok/s' "$work/$2_$1_throughput.log" | tail -1)$(grep -m1 -E 'Error' "$work/$2_$1_throughput.log")"
}
for mode in forward program; do
  profile $mode llama-1b 1; profile $mode llama-1b 32
done
for mode in forward program; do lat $mode llama-1b 1,8,32; done
for mode in forward program; do thr $mode llama-1b; done
for mode in forward program; do profile $mode llama-8b 1; done
for mode in forward program; do lat $mode llama-8b 1,32; done
tar czf "$OUT/stage_in_ab.tgz" -C "$work" . && rm -rf "$work"
