#!/usr/bin/env bash
# One H200 call (issues 45, 46): do any of XLA's fusion options merge the nine small kernels a layer
# that it leaves apart in the decode step (norms, residual adds, the SiLU product, converts, slices)?
# Per option set: llama-8b batch-1 decode through mesh_profile.py (engine ms per step, the forward
# replayed: host and device ms), a 2-step trace and its kernel count by kind (mesh_trace_summary.py).
# Everything lands in $OUT/fusion_flags.tgz.   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/fusion_flags.sh
set -u
. benchmarks/probes/device_setup.sh  # the carried wheels, PYTHONPATH
work=$OUT/w; mkdir -p "$work"
nvidia-smi -L
one() {  # NAME QUANT FLAGS...
  local name=$1 quant=$2; shift 2
  local q=(); [ "$quant" = fp8 ] && q=(--quantization fp8)
  XLA_FLAGS="$*" timeout 70 python benchmarks/probes/mesh_profile.py --model llama-8b -tp 1 -pp 1 --batch-size 1 \
    --steps 20 --profile-steps 2 "${q[@]}" --out "$work/$name" 2>&1 | grep -E "^\{|Error|Traceback" | python -c "import json,sys
for line in sys.stdin:
    if not line.startswith('{'): print('$name', line.rstrip()); continue
    r = json.loads(line); print('$name', 'ms/step %.3f' % r['ms_per_step'], 'replay fwd host/device %.3f/%.3f' % tuple(r['replay_forward_ms']))"
  python benchmarks/probes/mesh_trace_summary.py "$work/$name"/*.trace.json.gz > "$work/$name/summary.json" 2>/dev/null \
    && python -c "import json
t = json.load(open('$work/$name/summary.json'))[0]['device']['/device:GPU:0']
print('$name kernels', {k: (round(v['kernels_per_call']), round(v['ms_per_call'], 3)) for k, v in t.items() if k != 'top_kernels'})"
}
one default bf16
one heroless bf16 --xla_gpu_experimental_enable_triton_heroless_priority_fusion=true
one triton_mof bf16 --xla_gpu_unsupported_enable_triton_multi_output_fusion=true
one block_rewriter bf16 --xla_gpu_experimental_enable_fusion_block_level_rewriter=true
one fp8_default fp8
one fp8_subchannel fp8 --xla_gpu_experimental_enable_subchannel_dequantisation_fusion=true
one all_triton bf16 --xla_gpu_experimental_all_fusions_with_triton=true
tar czf "$OUT/fusion_flags.tgz" -C "$work" . && rm -rf "$work"
