#!/usr/bin/env bash
# One H200 call: does XLA's cuBLAS path (Triton GEMMs off) take the residual adds into its GEMMs' epilogues
# and so run fewer kernels a layer than the Triton GEMMs with their split-K reduces? Kernel-level profiles
# of batch-1 decode (mesh_profile.py, the default backend), llama-8b (bf16 and FP8 weights) and llama-1b,
# with XLA's defaults and with --xla_gpu_enable_triton_gemm=false. Everything lands in $OUT/gemm_backend.tgz.
#   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/gemm_backend.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
run() {  # NAME XLA_FLAGS MODEL [flags]
  local name=$1 flags=$2 m=$3; shift 3
  mkdir -p "$work/$name"
  ORCA_JAX_CACHE_DIR=/tmp/cache_$name XLA_FLAGS="$flags" timeout 100 python benchmarks/probes/mesh_profile.py \
    --model "$m" -tp 1 -pp 1 --batch-size 1 --out "$work/$name" "$@" 2>&1 | grep -E "^\{|Error|Traceback" | cut -c1-300
  for f in "$work/$name"/*.trace.json.gz; do mv "$f" "$work/$name.trace.json.gz"; done
}
run 8b_triton "" llama-8b
run 8b_cublas "--xla_gpu_enable_triton_gemm=false" llama-8b
run 8b_fp8_triton "" llama-8b --quantization fp8
run 1b_triton "" llama-1b
run 1b_cublas "--xla_gpu_enable_triton_gemm=false" llama-1b
python benchmarks/probes/mesh_trace_summary.py "$work"/*.trace.json.gz > "$work/trace_summary.json"
python - "$work/trace_summary.json" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1])):
    print("==", t["trace"], "host ms/forward", round(t["forward_host_ms_per_call_per_device"], 3))
    for dev, d in t["device"].items():
        print(" ", {k: (round(v["kernels_per_call"], 1), round(v["ms_per_call"], 3))
                    for k, v in d.items() if k != "top_kernels"})
        for k in d["top_kernels"][:12]:
            print("    %7.1f us %6.1f x  %s" % (k["us_per_call"], k["per_call"], k["kernel"][:70]))
PY
tar czf "$OUT/gemm_backend.tgz" -C "$work" . && rm -rf "$work"
