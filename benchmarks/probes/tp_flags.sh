#!/usr/bin/env bash
# The engine's batch-1 decode (mesh_profile.py) under the XLA options collective_graphs.py found:
# all-reduces recorded into the forward's CUDA graph (COLLECTIVES, XLA's one-shot all-reduce kernel
# off: it has no command form in jax 0.11.2), temporaries at fixed addresses (SKIP_TEMP, which
# takes the VMM allocator: XLA_FLAGS before the backend starts), NCCL symmetric buffers.
#   OUT=DIR benchmarks/probes/tp_flags.sh [MODEL]
set -u
model=${1:-llama-8b}
B="--xla_gpu_enable_command_buffer=+COLLECTIVES --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
S="$B --xla_gpu_experimental_enable_nccl_symmetric_buffers=true"
probe() {  # NAME TP PROFILE_STEPS [ENV...]
  local name=$1 tp=$2 steps=$3; shift 3
  env "$@" python benchmarks/probes/mesh_profile.py --model "$model" -tp "$tp" -pp 1 --steps 30 \
    --profile-steps "$steps" --out "$OUT/mp_$name" 2>&1 | grep -E '^\{|Error|error' | tail -2 \
    | python -c "import json,sys
for l in sys.stdin:
  try: r=json.loads(l)
  except Exception: print('$name', l.strip()[:400]); continue
  print('$name', {k: r[k] for k in ('ms_per_step','host_ms_per_iteration','device_wait_ms_per_iteration','replay_execute_ms','replay_forward_ms','replay_sample_ms')})"
}
nvidia-smi -L
probe tp1_defaults 1 0
probe tp1_skip_temp 1 0 XLA_FLAGS="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
probe tp2_defaults 2 0
probe tp2_graph 2 0 XLA_FLAGS="$B"
probe tp2_graph_symmetric 2 6 XLA_FLAGS="$S --xla_enable_command_buffers_during_profiling=true" XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB=64
for t in "$OUT"/mp_tp2_graph_symmetric/*.trace.json.gz; do
  python benchmarks/probes/mesh_trace_summary.py "$t" > "${t%.trace.json.gz}.summary.json" && rm "$t"
done
