#!/usr/bin/env bash
# One nvidia-h200-x2 call (issues 45 and 46, sixth session): tensor parallelism at the code of now, and where a
# host-bound llama-1b step goes at 32 and 256 sequences.
# PART=1 (before any change):
#   llama-8b (1, 1) against (2, 1): `bench latency` at batch 1, 8, 32 and the ORCA trace, same machine;
#   a profile of (2, 1) batch-1 decode (mesh_profile.py: the step, the replay, a jax trace);
#   llama-1b on one GPU at 32 and 256 sequences: mesh_profile.py with a trace (the dispatch thread's and the
#   engine thread's host timelines beside the device's).
# PART=2 (sampling inside the decode forward, ForwardKey.sampled; XLA's SKIP_PROFILED update mode):
#   llama-1b `bench latency` at batch 1, 8, 32, fused against --no-fuse-decode-sampling, twice (the pair
#   reversed); the ORCA trace the same way; llama-8b batch 1 and 32 both ways; (2, 1) batch 1 and 32 both
#   ways; llama-1b with --xla_gpu_command_buffer_update_mode=SKIP_PROFILED against the engine's SKIP_TEMP.
# PART=3: the ORCA trace at (1, 1) and (2, 1) with sampling in the decode forward, and (2, 1) without;
#   a profile of (2, 1) batch-1 decode with it; llama-1b batch 1 and 32 once more both ways.
# PART=4: the ORCA trace at (2, 1) with sampling in the forward and without, twice (the pair reversed),
#   then at (1, 1) both ways.
# PART=5 (issue 46): llama-8b batch 1 and 32 in bf16 and FP8 (sampling in the forward and not), and FP8
#   at (2, 1).
# PART=6: FP8 at (2, 1) ran at 18 ms a step in PART=5: batch 1 with the head in bf16, without sampling in
#   the forward, and a profile.
# Each run is skipped once fewer than its seconds are left of the call's DEADLINE (default 560 s).
# JSON and traces land in $OUT/round6_PART.tgz (a call brings back 8 files at most).
#   OUT=DIR ORCA_JAX_COMMIT=SHA PART=1 benchmarks/probes/round6_h200x2.sh
set -u
. benchmarks/probes/device_setup.sh
work=/tmp/round6_${PART:-1}; mkdir -p "$work"
. benchmarks/probes/bench_lib.sh
nvidia-smi -L
deadline=${DEADLINE:-560}
fits() { [ $((deadline - SECONDS)) -ge "$1" ] || { echo "skipped ($1 s needed, $((deadline - SECONDS)) left): $2"; return 1; }; }
profile() {  # NAME-free: mesh_profile.py's JSON and trace land in $work under its own name
  timeout 110 python benchmarks/probes/mesh_profile.py "$@" --out "$work" 2>&1 | grep -E "^\{|Error|Traceback" | cut -c1-600
}
if [ "${PART:-1}" = 1 ]; then
  fits 150 lat_tp1 && LAT_TIMEOUT=150 lat llama-8b_tp1_pp1 llama-8b 1,8,32
  fits 150 lat_tp2 && LAT_TIMEOUT=150 lat llama-8b_tp2_pp1 llama-8b 1,8,32 -tp 2
  fits 120 thr_tp1 && THR_TIMEOUT=120 thr llama-8b_tp1_pp1 llama-8b
  fits 120 thr_tp2 && THR_TIMEOUT=120 thr llama-8b_tp2_pp1 llama-8b -tp 2
  fits 100 prof_tp2 && profile --model llama-8b -tp 2 -pp 1 --batch-size 1 --steps 30 --profile-steps 6
  fits 80 prof_1b_32 && profile --model llama-1b --batch-size 32 --steps 30 --profile-steps 6
  fits 80 prof_1b_256 && profile --model llama-1b --batch-size 256 --input-len 128 --steps 30 --profile-steps 4
fi
if [ "${PART:-1}" = 2 ]; then
  nofuse=--no-fuse-decode-sampling
  fits 60 l1 && lat llama-1b_fused llama-1b 1,8,32
  fits 60 l2 && lat llama-1b_apart llama-1b 1,8,32 $nofuse
  fits 60 l3 && lat llama-1b_apart_rep llama-1b 1,8,32 $nofuse
  fits 60 l4 && lat llama-1b_fused_rep llama-1b 1,8,32
  fits 70 t1 && thr llama-1b_apart llama-1b $nofuse --num-runs 2
  fits 70 t2 && thr llama-1b_fused llama-1b --num-runs 2
  fits 70 t3 && thr llama-1b_fused_rep llama-1b --num-runs 2
  fits 70 t4 && thr llama-1b_apart_rep llama-1b $nofuse --num-runs 2
  fits 60 p1 && XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_PROFILED lat llama-1b_skip_profiled llama-1b 1,8,32
  fits 90 e1 && lat llama-8b_apart llama-8b 1,32 $nofuse
  fits 90 e2 && lat llama-8b_fused llama-8b 1,32
  fits 100 e3 && lat llama-8b_tp2_apart llama-8b 1,32 -tp 2 $nofuse
  fits 100 e4 && lat llama-8b_tp2_fused llama-8b 1,32 -tp 2
fi
if [ "${PART:-1}" = 3 ]; then
  nofuse=--no-fuse-decode-sampling
  fits 100 t1 && thr llama-8b_tp1_fused llama-8b
  fits 100 t2 && thr llama-8b_tp2_fused llama-8b -tp 2
  fits 100 t3 && thr llama-8b_tp2_apart llama-8b -tp 2 $nofuse
  fits 90 p1 && profile --model llama-8b -tp 2 -pp 1 --batch-size 1 --steps 30 --profile-steps 6
  fits 50 l1 && lat llama-1b_apart llama-1b 1,32 $nofuse
  fits 50 l2 && lat llama-1b_fused llama-1b 1,32
fi
if [ "${PART:-1}" = 4 ]; then
  nofuse=--no-fuse-decode-sampling
  fits 70 t1 && thr llama-8b_tp2_apart llama-8b -tp 2 $nofuse --num-runs 2
  fits 70 t2 && thr llama-8b_tp2_fused llama-8b -tp 2 --num-runs 2
  fits 70 t3 && thr llama-8b_tp2_fused_rep llama-8b -tp 2 --num-runs 2
  fits 70 t4 && thr llama-8b_tp2_apart_rep llama-8b -tp 2 $nofuse --num-runs 2
  fits 70 t5 && thr llama-8b_tp1_fused llama-8b --num-runs 2
  fits 70 t6 && thr llama-8b_tp1_apart llama-8b $nofuse --num-runs 2
fi
if [ "${PART:-1}" = 5 ]; then
  fits 60 b1 && lat llama-8b_bf16 llama-8b 1,32
  fits 60 f1 && lat llama-8b_fp8 llama-8b 1,32 -q fp8
  fits 60 f2 && lat llama-8b_fp8_apart llama-8b 1,32 -q fp8 --no-fuse-decode-sampling
  fits 80 f3 && lat llama-8b_fp8_tp2 llama-8b 1,32 -q fp8 -tp 2
  fits 60 b2 && lat llama-8b_bf16_rep llama-8b 1,32
fi
if [ "${PART:-1}" = 6 ]; then
  fits 70 h1 && lat llama-8b_fp8_tp2_bf16head llama-8b 1 -q fp8 -tp 2 --no-quantize-lm-head
  fits 70 h2 && lat llama-8b_fp8_tp2_apart llama-8b 1 -q fp8 -tp 2 --no-fuse-decode-sampling
  fits 90 p1 && profile --model llama-8b -tp 2 -pp 1 --batch-size 1 --steps 12 --profile-steps 3 --quantization fp8
fi
ls "$work"
[ -n "$(ls "$work"/*.trace.json.gz 2>/dev/null)" ] && summarize_traces "$work" 2>&1 | head -80
tar czf "$OUT/round6_${PART:-1}.tgz" -C "$work" .
echo "done in $SECONDS s"
