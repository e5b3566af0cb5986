#!/usr/bin/env bash
# Probe: tensor parallelism over 2 GPUs served by one process driving both, against two controller
# processes of one GPU each (jax.distributed, process 0 serving), through the HTTP server with the
# ORCA trace (bench serve). Prints each server's start-up seconds (to /health 200) and writes the
# bench results to OUT_DIR.
#   benchmarks/probes/multiprocess_serve.sh OUT_DIR [MODEL]
set -u
out=${1:?OUT_DIR}; model=${2:-llama-8b}
mkdir -p "$out"
flags=(--model "$model" --tensor-parallel-size 2 --max-num-seqs 256 --max-num-batched-tokens 8192
       --no-enable-prefix-caching --kv-allocation reserve --scheduling-policy fcfs --no-priority-preemption
       --log-level warning --disable-log-requests --disable-uvicorn-access-log --port 8000)
bench=(python3 -m orca_jax.bench serve --model "$model" --base-url http://127.0.0.1:8000 --ignore-eos
       --num-runs 2 --disable-tqdm --max-num-seqs 256 --max-num-batched-tokens 8192)

wait_ready() {  # seconds until /health answers 200, or fail after $1 s
  local start=$SECONDS
  until python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/health', timeout=2).status_code != 200)" 2>/dev/null; do
    sleep 0.5; if (( SECONDS - start > $1 )); then echo "not ready after $1 s"; return 1; fi
  done
  echo "ready after $(( SECONDS - start )) s"
}

echo "== one process, 2 GPUs"
python3 -m orca_jax.serve "${flags[@]}" > "$out/one_process.log" 2>&1 &
server=$!
wait_ready 400 && "${bench[@]}" --result-dir "$out" --result-filename one_process_serve.json | tail -25
kill $server; wait $server

echo "== two processes, 1 GPU each"
for i in 1 0; do
  CUDA_VISIBLE_DEVICES=$i python3 -m orca_jax.serve "${flags[@]}" --coordinator-address 127.0.0.1:12355 \
    --num-processes 2 --process-id $i > "$out/process_$i.log" 2>&1 &
  pids[$i]=$!
done
wait_ready 400 && "${bench[@]}" --result-dir "$out" --result-filename two_processes_serve.json | tail -25
kill ${pids[0]}; wait ${pids[0]} ${pids[1]}
echo "exit statuses: process 0 $?"
tail -3 "$out/process_1.log"
