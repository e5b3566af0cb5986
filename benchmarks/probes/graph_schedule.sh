#!/usr/bin/env bash
# One H200 call (issue 45): does the forward's CUDA graph launch faster when XLA records it as one
# chain of kernels? The decode-step profile (decode_step_h200.sh) found one cuGraphLaunch per forward
# taking 0.85 ms of host for llama-1b's ~260 kernels (1.2 ms for llama-8b's ~500): as long as the
# device's work. XLA's --xla_gpu_command_buffer_scheduling_mode picks how the graph's nodes depend on
# each other: a DAG from data dependencies (the default) or SERIALIZE, one after another. Per mode:
# mesh_profile's replay (host ms per forward launch, device ms per forward) at llama-1b batch 1 and 32
# and llama-8b batch 1, then `bench latency` for llama-1b (batch 1, 8, 32).
#   OUT=DIR ORCA_JAX_COMMIT=SHA [MODES="default SERIALIZE CONCURRENT"] benchmarks/probes/graph_schedule.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
for mode in ${MODES:-default SERIALIZE}; do
  flags=""; [ "$mode" != default ] && flags="--xla_gpu_command_buffer_scheduling_mode=$mode"
  for spec in "llama-1b 1" "llama-1b 32" "llama-8b 1"; do
    set -- $spec
    XLA_FLAGS="$flags" timeout 100 python benchmarks/probes/mesh_profile.py --model "$1" -tp 1 -pp 1 --batch-size "$2" \
      --profile-steps 0 --steps 30 --out "$work/$mode" 2>&1 | grep -E "^\{|Error|Traceback" \
      | python -c "import json,sys
for line in sys.stdin:
    if not line.startswith('{'): print(line.rstrip()); continue
    r = json.loads(line); print('$mode', '$1', 'b$2', 'ms/step %.3f' % r['ms_per_step'], 'host/it %.3f' % r['host_ms_per_iteration'],
          'dispatch %.3f' % r['dispatch_ms'], 'replay fwd host/device %.3f/%.3f' % tuple(r['replay_forward_ms']),
          'execute %.3f/%.3f' % tuple(r['replay_execute_ms']))"
  done
  XLA_FLAGS="$flags" timeout 150 python -m orca_jax.bench latency --model llama-1b --max-num-seqs 256 \
    --max-num-batched-tokens 8192 --no-enable-prefix-caching --compilation-cache-dir /tmp/cc_$mode --batch-size 1,8,32 \
    --async-scheduling on --num-iters 1 --num-iters-warmup 1 --decode-steps 30 --output-len 16 --result-dir "$work" \
    --result-filename "llama-1b_${mode}_latency.json" > "$work/llama-1b_${mode}_latency.log" 2>&1
  python -c "import json
for r in json.load(open('$work/llama-1b_${mode}_latency.json'))['rows']:
    print('$mode llama-1b latency batch', r['batch_size'], 'ms/it %.3f' % r['ms_per_iteration'], 'device busy %.3f' % r['device_busy_ms'])" \
    || tail -5 "$work/llama-1b_${mode}_latency.log"
done
tar czf "$OUT/graph_schedule.tgz" -C "$work" . && rm -rf "$work"
