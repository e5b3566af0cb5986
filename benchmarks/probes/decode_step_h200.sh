#!/usr/bin/env bash
# One H200 call for the decode step (issue 45): a kernel-level profile of llama-1b's decode step (batch 1
# and 32) and llama-8b's (batch 1), then `bench latency` (batch 1, 8, 32) and `bench throughput` (the ORCA
# trace) for both models, each with the change under test on (the default) and off (ENV_OFF, when given).
# Everything lands in $OUT/decode_step_h200.tgz.
#   OUT=DIR ORCA_JAX_COMMIT=SHA [ENV_OFF="NAME=0"] [PROFILE=1] benchmarks/probes/decode_step_h200.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
engine=(--max-num-seqs 256 --max-num-batched-tokens 8192 --no-enable-prefix-caching --compilation-cache-dir /tmp/cc)
quiet() { grep -E " batch|tok/s|tokens/s|Error|error|Traceback" | grep -v "^W0" | head -12; }
if [ "${PROFILE:-1}" = 1 ]; then
  for spec in "llama-1b 1" "llama-1b 32" "llama-8b 1" "llama-8b 1 --quantization fp8"; do
    set -- $spec
    timeout 100 python benchmarks/probes/mesh_profile.py --model "$1" -tp 1 -pp 1 --batch-size "$2" "${@:3}" \
      --out "$work" 2>&1 | grep -E "^\{|Error|Traceback" | cut -c1-600
  done
  python benchmarks/probes/mesh_trace_summary.py "$work"/*.trace.json.gz > "$work/trace_summary.json"
  python - "$work/trace_summary.json" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1])):
    print("==", t["trace"], "host ms/forward", round(t["forward_host_ms_per_call_per_device"], 3),
          {k: round(v, 3) for k, v in t["host_ms_per_call_per_device"].items()})
    for dev, d in t["device"].items():
        print(" ", dev, {k: (round(v["kernels_per_call"], 1), round(v["ms_per_call"], 3))
                         for k, v in d.items() if k != "top_kernels"})
        for k in d["top_kernels"][:25]:
            print("    %7.1f us %6.1f x  %s" % (k["us_per_call"], k["per_call"], k["kernel"][:90]))
PY
fi
if [ "${HOST_PROFILE:-0}" = 1 ]; then  # the host's split of an iteration at 1, 32, 256 sequences
  timeout 200 python benchmarks/probes/host_profile.py --model llama-1b --precompile --cprofile 30 \
    --json "$work/host_profile_llama-1b.json" 2>&1 | grep -vE "^W0|^I0|compiling" | tail -12
fi
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
both() {  # KIND NAME MODEL [args]: the change on, then off (when ENV_OFF names it)
  local kind=$1 name=$2; shift 2
  $kind "$name" "$@"
  if [ -n "${ENV_OFF:-}" ]; then env "$ENV_OFF" bash -c "$(declare -f lat thr quiet); engine=(${engine[*]}); \
    work=$work; $kind ${name}_off $*"; fi
}
if [ "${BENCH:-1}" = 1 ]; then
  both lat llama-1b llama-1b 1,8,32
  both lat llama-8b llama-8b 1,8,32
  both thr llama-1b llama-1b
  both thr llama-8b llama-8b
fi
${EXTRA:-true}
tar czf "$OUT/decode_step_h200.tgz" -C "$work" . && rm -rf "$work"
