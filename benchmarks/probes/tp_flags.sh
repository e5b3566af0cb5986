#!/usr/bin/env bash
# The engine's batch-1 decode (mesh_profile.py: ms per step, the host's share, a replay) at (1, 1) and
# (2, 1) under XLA's defaults and under the options worker/xla_setup.py sets for tensor parallelism.
#   OUT=DIR benchmarks/probes/tp_flags.sh [MODEL] [SMALL_MODEL]
# First form (tree 6626856, before the engine's own buffers stayed put): the options given by hand,
# `probe tp1_skip_temp 1 XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP`, `tp2_graph` (all
# but the symmetric buffers) and `tp2_graph_symmetric` (all, profiled).
set -u
model=${1:-llama-8b}; small=${2:-llama-1b}
probe() {  # NAME MODEL TP [ENV...]
  local name=$1 m=$2 tp=$3; shift 3
  env "$@" python benchmarks/probes/mesh_profile.py --model "$m" -tp "$tp" -pp 1 --steps 30 \
    --profile-steps 0 --out "$OUT/mp_$name" 2>&1 | grep -E '^\{|Error|error' | tail -2 \
    | python -c "import json,sys
for l in sys.stdin:
  try: r=json.loads(l)
  except Exception: print('$name', l.strip()[:400]); continue
  print('$name', {k: r[k] for k in ('ms_per_step','host_ms_per_iteration','device_wait_ms_per_iteration','replay_execute_ms','replay_forward_ms','replay_sample_ms')})"
}
nvidia-smi -L
probe tp1 "$model" 1
probe tp2_xla_defaults "$model" 2 ORCA_JAX_XLA_DEFAULTS=0
probe tp2 "$model" 2
probe tp2_always_update "$model" 2 XLA_FLAGS=--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE
probe small_tp1 "$small" 1
