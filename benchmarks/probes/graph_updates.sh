#!/usr/bin/env bash
# Why a step's CUDA graphs are updated: XLA's command-buffer log (which recorded allocations moved)
# and a profile with the graphs kept on, for one layout's batch-1 decode (mesh_profile.py).
#   OUT=DIR benchmarks/probes/graph_updates.sh MODEL TP
set -u
model=$1; tp=$2; name=${model}_tp${tp}
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=2 \
XLA_FLAGS="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true" \
  python benchmarks/probes/mesh_profile.py --model "$model" -tp "$tp" -pp 1 --steps 30 --profile-steps 6 \
  --out "$OUT/$name" > "$OUT/$name.log" 2>&1
grep -E '^\{' "$OUT/$name.log" | tail -1 | cut -c1-600
# The log's messages without their time, thread and address noise, most frequent first.
sed -E 's/^[IWE][0-9]{4} [0-9:.]+ +[0-9]+ //; s/0x[0-9a-f]+/0x/g; s/[0-9]+/N/g' "$OUT/$name.log" \
  | grep -iE 'command buffer|update|record|alloc' | sort | uniq -c | sort -rn | head -25 > "$OUT/${name}_log_summary.txt"
cat "$OUT/${name}_log_summary.txt"
gzip -f "$OUT/$name.log"
for t in "$OUT/$name"/*.trace.json.gz; do
  python benchmarks/probes/mesh_trace_summary.py "$t" > "${t%.trace.json.gz}.summary.json" && rm "$t"
  python -c "import json,sys; d=json.load(open(sys.argv[1]))[0]; print(json.dumps({k: d[k] for k in ('forward_host_ms_per_call_per_device','host_ms_per_call_per_device')}))" "${t%.trace.json.gz}.summary.json"
done
