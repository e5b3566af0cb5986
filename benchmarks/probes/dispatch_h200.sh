#!/usr/bin/env bash
# One H200 call for the dispatch thread (issue 45, engine/dispatcher.py): the engine's launches on a thread
# of their own against inline launches, same call, each pair inline first.
# PART=1: llama-1b (host-bound): a profile of batch-1 decode with the thread (mesh_profile.py, its replays
#   and host split), `bench latency` at batch 1, 8, 32 twice (the pair reversed the second time: this host's
#   speed drifts), the ORCA trace.
# PART=2: llama-8b (issue 46): latency at batch 1 and 32 and the ORCA trace in bf16, in FP8 with the LM head
#   in bf16 (--no-quantize-lm-head) and in FP8 with the head in e4m3 (the default).
# PART=3: the ORCA trace on llama-1b again, three runs each, inline / thread / thread with the GIL's switch
#   interval at 1 ms and 5 ms instead of the dispatcher's 0.2 ms / inline again; then llama-8b bf16, thread
#   on and off.
# PART=4: llama-1b latency and the trace with the dispatcher's 0.5 ms against 0.2 ms and inline.
# PART=5: the final figures: llama-1b latency and trace, thread against inline, twice; llama-8b FP8's trace
#   with the head in e4m3 and in bf16, twice; the engine's host split at 1/32/256 sequences (host_profile.py).
# JSON and traces land in $OUT/dispatch_PART.tgz (a call brings back 8 files at most).
#   OUT=DIR ORCA_JAX_COMMIT=SHA PART=1|2 benchmarks/probes/dispatch_h200.sh
set -u
. benchmarks/probes/device_setup.sh
work=/tmp/dispatch_${PART:-1}; mkdir -p "$work"
. benchmarks/probes/bench_lib.sh
nvidia-smi -L
if [ "${PART:-1}" = 1 ]; then
  for mode in off on; do
    timeout 100 python benchmarks/probes/mesh_profile.py --model llama-1b -tp 1 -pp 1 --batch-size 1 \
      --dispatch-thread "$mode" --profile-steps "$([ $mode = on ] && echo 8 || echo 0)" --out "$work" 2>&1 \
      | grep -E "^\{|Error|Traceback" | cut -c1-700
  done
  summarize_traces "$work"
  lat llama-1b_inline llama-1b 1,8,32 --no-dispatch-thread
  lat llama-1b_thread llama-1b 1,8,32
  lat llama-1b_thread_rep llama-1b 1,8,32
  lat llama-1b_inline_rep llama-1b 1,8,32 --no-dispatch-thread
  thr llama-1b_inline llama-1b --no-dispatch-thread
  thr llama-1b_thread llama-1b
fi
if [ "${PART:-1}" = 2 ]; then  # issue 46: FP8 (head e4m3, the default; head bf16) against bf16, llama-8b
  lat llama-8b_bf16 llama-8b 1,32
  lat llama-8b_fp8_bf16head llama-8b 1,32 -q fp8 --no-quantize-lm-head
  lat llama-8b_fp8 llama-8b 1,32 -q fp8
  thr llama-8b_bf16 llama-8b
  thr llama-8b_fp8_bf16head llama-8b -q fp8 --no-quantize-lm-head
  thr llama-8b_fp8 llama-8b -q fp8
fi
si_bench() {  # NAME INTERVAL_S SUBCOMMAND MODEL [flags]: a bench run with the dispatcher's switch interval replaced
  local name=$1 si=$2 sub=$3 m=$4; shift 4
  timeout 150 python -c "import runpy, sys; import orca_jax.engine.dispatcher as d; d.SWITCH_INTERVAL_S = $si
sys.argv = ['bench'] + sys.argv[1:]; runpy.run_module('orca_jax.bench', run_name='__main__')" "$sub" \
    --model "$m" "${engine[@]}" --result-dir "$work" --result-filename "${name}_$sub.json" "$@" 2>&1 \
    | sed "s/^/$name /" | quiet
}
trace=(--dataset-name uniform --num-runs 3)
latency=(--batch-size 1,8,32 --async-scheduling on --num-iters 1 --num-iters-warmup 1 --decode-steps 30 --output-len 16)
if [ "${PART:-1}" = 3 ]; then
  thr llama-1b_inline3 llama-1b --no-dispatch-thread --num-runs 3
  thr llama-1b_thread3 llama-1b --num-runs 3
  si_bench llama-1b_thread3_si1ms 0.001 throughput llama-1b "${trace[@]}"
  si_bench llama-1b_thread3_si5ms 0.005 throughput llama-1b "${trace[@]}"
  thr llama-1b_inline3_rep llama-1b --no-dispatch-thread --num-runs 3
  lat llama-8b_inline llama-8b 1,32 --no-dispatch-thread
  lat llama-8b_thread llama-8b 1,32
  thr llama-8b_inline llama-8b --no-dispatch-thread
  thr llama-8b_thread llama-8b
fi
if [ "${PART:-1}" = 4 ]; then  # the dispatcher's interval at 0.5 ms (its default since PART=3) against 0.2 ms and inline
  lat llama-1b_inline llama-1b 1,8,32 --no-dispatch-thread
  lat llama-1b_thread_si05ms llama-1b 1,8,32
  si_bench llama-1b_thread_si02ms 0.0002 latency llama-1b "${latency[@]}"
  lat llama-1b_inline_rep llama-1b 1,8,32 --no-dispatch-thread
  thr llama-1b_inline3 llama-1b --no-dispatch-thread --num-runs 3
  thr llama-1b_thread3_si05ms llama-1b --num-runs 3
  si_bench llama-1b_thread3_si02ms 0.0002 throughput llama-1b "${trace[@]}"
  thr llama-1b_inline3_rep llama-1b --no-dispatch-thread --num-runs 3
fi
if [ "${PART:-1}" = 5 ]; then
  lat llama-1b_inline llama-1b 1,8,32 --no-dispatch-thread
  lat llama-1b_thread llama-1b 1,8,32
  lat llama-1b_thread_rep llama-1b 1,8,32
  lat llama-1b_inline_rep llama-1b 1,8,32 --no-dispatch-thread
  thr llama-1b_inline3 llama-1b --no-dispatch-thread --num-runs 3
  thr llama-1b_thread3 llama-1b --num-runs 3
  thr llama-1b_thread3_rep llama-1b --num-runs 3
  thr llama-1b_inline3_rep llama-1b --no-dispatch-thread --num-runs 3
  thr llama-8b_fp8_bf16head llama-8b -q fp8 --no-quantize-lm-head --num-runs 2
  thr llama-8b_fp8 llama-8b -q fp8 --num-runs 2
  thr llama-8b_fp8_rep llama-8b -q fp8 --num-runs 2
  thr llama-8b_fp8_bf16head_rep llama-8b -q fp8 --no-quantize-lm-head --num-runs 2
  timeout 120 python benchmarks/probes/host_profile.py --model llama-1b --precompile --json "$work/host_profile_llama-1b.json" \
    2>&1 | grep -E "^\{|seqs|step|Error|Traceback" | cut -c1-300 | head -20
fi
ls "$work"
tar czf "$OUT/dispatch_${PART:-1}.tgz" -C "$work" .
