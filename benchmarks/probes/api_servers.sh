#!/usr/bin/env bash
# Probe (issue 49): several API server processes in front of the engine cores, on one nvidia-h200-x4 call of
# at most ~9 minutes. `bench serve --launch` (serve's own engine defaults for the model and the H200, prefix
# caching off, 1,024 requests of the ORCA trace's lengths sent at once, EOS ignored) for llama-8b and llama-1b:
# one replica as serve runs it by default (the engine on a thread of the one API server process), with its
# core in its own process, and behind 4 API servers; 4 replicas (--data-parallel-size 4) behind 1 and 4 API
# servers. The first launch of each model also runs the same requests in process on one GPU
# (--compare-in-process), the ratios' denominator. Then, if time is
# left, llama-8b at --data-parallel-size 2 --tensor-parallel-size 2 behind 2 API servers (replicas of a
# tensor-parallel engine). Every launch replays its requests twice (the second is the one to read).
# One compilation cache serves every launch, so only the first of each model compiles cold.
#   bash benchmarks/probes/api_servers.sh          # results: $OUT/summary.json, $OUT/api_servers.tar.gz
# BUDGET_S (default 480): no launch starts after this many seconds.
set -u
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
out=${OUT:-/tmp/api_servers_out}; work=/tmp/api_servers; cache=/tmp/api_servers_cache
mkdir -p "$out" "$work" "$cache"
budget=${BUDGET_S:-480}; start=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4
echo "python $(python3 -c 'import sys; print(sys.version.split()[0])'), $(nproc) CPUs"

gpus=$(nvidia-smi -L | wc -l)
launch() {  # launch NAME FLAGS...: one bench serve --launch, results under $work/NAME
  local name=$1; shift
  local dp=1 tp=1 prev=
  for a in "$@"; do
    [ "$prev" = --data-parallel-size ] && dp=$a
    [ "$prev" = --tensor-parallel-size ] && tp=$a
    prev=$a
  done
  if (( dp * tp > gpus )); then echo "== $name: skipped, needs $(( dp * tp )) GPUs"; return; fi
  local elapsed=$(( SECONDS - start ))
  if (( elapsed > budget )); then echo "== $name: skipped, $elapsed s in"; return; fi
  echo "== $name ($elapsed s in): $*"
  mkdir -p "$work/$name"
  timeout $(( budget + 90 - elapsed )) python3 -m orca_jax.bench serve --launch --ignore-eos --disable-tqdm \
    --no-enable-prefix-caching --num-runs 2 --compilation-cache-dir "$cache" --port 8765 \
    --result-dir "$work/$name" --result-filename result.json "$@" > "$work/$name/bench.log" 2>&1
  echo "   exit $?; $(grep -E 'output token throughput|HTTP / in-process' "$work/$name/bench.log" | tail -2 | tr '\n' ' ')"
}

# The must-shows first (a launch past the budget is skipped): llama-8b one replica over HTTP against in
# process, llama-8b's and llama-1b's four replicas behind four API servers; then the rest.
launch llama-8b_dp1_thread --model llama-8b --num-prompts 1024 --compare-in-process  # serve's default: in-thread
launch llama-8b_dp4_api4 --model llama-8b --num-prompts 1024 --data-parallel-size 4 --api-server-count 4
launch llama-1b_dp4_api4 --model llama-1b --num-prompts 1024 --data-parallel-size 4 --api-server-count 4 \
  --compare-in-process
for model in llama-8b llama-1b; do
  launch ${model}_dp4_api1 --model $model --num-prompts 1024 --data-parallel-size 4 --api-server-count 1
  launch ${model}_dp1_api4 --model $model --num-prompts 1024 --api-server-count 4
  launch ${model}_dp1_process --model $model --num-prompts 1024 --engine-process --api-server-count 1
done
launch llama-8b_dp2_tp2_api2 --model llama-8b --num-prompts 512 --data-parallel-size 2 --tensor-parallel-size 2 \
  --api-server-count 2

python3 - "$work" "$out/summary.json" <<'EOF'
import glob, json, os, sys
work, path = sys.argv[1:]
summary = {}
for result in sorted(glob.glob(os.path.join(work, "*", "result.json"))):
    r = json.load(open(result))
    runs = [{k: run.get(k) for k in ("completed", "failed", "output_throughput", "duration_s", "client_cpu_s", "engine")}
            | {f"{m}_ms": {q: run.get(f"{m}_ms", {}).get(q) for q in ("p50", "p90", "p99", "mean")}
               for m in ("ttft", "tpot", "itl")} for run in r.get("runs", [])]
    summary[os.path.basename(os.path.dirname(result))] = {
        "runs": runs, "server": r.get("server"), "in_process": [
            {k: p.get(k) for k in ("tokens_per_s", "wall_s", "iterations", "mean_batch_size", "host_s", "device_wait_s")}
            for p in r.get("in_process", [])],
        "in_process_engine": r.get("in_process_engine"), "http_over_in_process": r.get("http_over_in_process"),
        "device": r.get("device"), "commit": r.get("commit")}
json.dump(summary, open(path, "w"), indent=1)
for name, s in summary.items():
    tput = [round(run["output_throughput"] or 0) for run in s["runs"]]
    print(name, "tok/s", tput, "p99 ITL", [run["itl_ms"]["p99"] for run in s["runs"]][-1:],
          "ready s", round((s["server"] or {}).get("process_to_ready_s") or 0), "in process",
          [round(p["tokens_per_s"] or 0) for p in s["in_process"]])
EOF
tar -czf "$out/api_servers.tar.gz" -C "$work" .
ls -la "$out"
