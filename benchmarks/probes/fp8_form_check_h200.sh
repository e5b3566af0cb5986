#!/usr/bin/env bash
# One short nvidia-h200 call: llama-8b FP8 batch 1 and 32 after fp8.linear kept the weights' output axes
# (the fix for FP8 under tensor parallelism), against bf16 in the same call.
#   OUT=DIR ORCA_JAX_COMMIT=SHA benchmarks/probes/fp8_form_check_h200.sh
set -u
. benchmarks/probes/device_setup.sh
work=/tmp/fp8_form; mkdir -p "$work"
. benchmarks/probes/bench_lib.sh
LAT_TIMEOUT=240 lat llama-8b_fp8 llama-8b 1,32 -q fp8
LAT_TIMEOUT=150 lat llama-8b_bf16 llama-8b 1,32
tar czf "$OUT/fp8_form.tgz" -C "$work" .
