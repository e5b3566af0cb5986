# Sourced by the device probes after device_setup.sh: the bench wrappers they share. Each writes its JSON
# under $work (set it first) and prints only the lines that matter, prefixed with the run's name.
#   lat NAME MODEL BATCHES [flags]   `bench latency` (async scheduling, 3 windows of 30 timed decode steps, context 512)
#   thr NAME MODEL [flags]           `bench throughput` on the ORCA trace (512 requests, one run)
#   summarize_traces DIR             mesh_trace_summary.py over DIR's traces, printed kernel class by class
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching --compilation-cache-dir /tmp/cc)
quiet() { grep -E " batch|tok/s|tokens/s|Error|error|Traceback" | grep -v "^W0" | head -12; }
lat() {
  local name=$1 m=$2 bs=$3; shift 3
  timeout "${LAT_TIMEOUT:-150}" python -m orca_jax.bench latency --model "$m" "${engine[@]}" --batch-size "$bs" \
    --async-scheduling on --num-iters 1 --num-iters-warmup 1 --decode-steps 30 --decode-repeats 3 --output-len 16 --result-dir "$work" \
    --result-filename "${name}_latency.json" "$@" 2>&1 | sed "s/^/$name /" | quiet
}
thr() {
  local name=$1 m=$2; shift 2
  timeout "${THR_TIMEOUT:-120}" python -m orca_jax.bench throughput --model "$m" "${engine[@]}" --dataset-name uniform \
    --num-runs 1 --result-dir "$work" --result-filename "${name}_throughput.json" "$@" 2>&1 | sed "s/^/$name /" | quiet
}
summarize_traces() {
  python benchmarks/probes/mesh_trace_summary.py "$1"/*.trace.json.gz > "$1/trace_summary.json"
  python - "$1/trace_summary.json" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1])):
    print("==", t["trace"], "host ms/forward", round(t["forward_host_ms_per_call_per_device"], 3))
    for dev, d in t["device"].items():
        print(" ", {k: (round(v["kernels_per_call"], 1), round(v["ms_per_call"], 3))
                    for k, v in d.items() if k != "top_kernels"})
        for k in d["top_kernels"][:10]:
            print("    %7.1f us %6.1f x  %s" % (k["us_per_call"], k["per_call"], k["kernel"][:70]))
PY
}
