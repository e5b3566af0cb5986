#!/usr/bin/env bash
# Which buffers of a decode step move between steps (step_buffers.py), and how often XLA updates each
# program's CUDA graph (its command-buffer log), under XLA's command-buffer options given as arguments.
#   OUT=DIR benchmarks/probes/step_buffers.sh MODEL "NAME=XLA_FLAGS ..."
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
model=$1; shift
plugin=$(python -c "import jax_plugins.xla_cuda13 as p, os; print(os.path.dirname(p.__file__))" 2>/dev/null)
[ -n "$plugin" ] && strings "$plugin"/*.so | grep -E "command_buffer_(update|va)|SKIP_TEMP|ALWAYS_UPDATE|va_remapping" | sort -u | head -20
for variant in "$@"; do
  name=${variant%%=*}; flags=${variant#*=}
  echo "== $name: $flags"
  XLA_FLAGS="$flags" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
    timeout 150 python benchmarks/probes/step_buffers.py --model "$model" --steps 12 > "$OUT/$name.log" 2>&1
  sed -n '/^{/,/^}/p' "$OUT/$name.log" | tr -d '\n ' | cut -c1-700; echo
  grep -E "updated_allocs" "$OUT/$name.log" | sed -E 's/.*num_commands=([0-9]+); updated_allocs=([0-9]+).*/commands=\1 updated_allocs=\2/' | sort | uniq -c
  grep -E "Error|error:" "$OUT/$name.log" | head -3
  gzip -f "$OUT/$name.log"
done
