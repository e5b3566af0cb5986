"""RESERVE vs ON_DEMAND KV allocation through the real server (issue 14's before/after lines).

For each configuration: start `python -m orca_jax.serve` on SmolLM2-135M, send 3 concurrent chats
that name no max_tokens (the openai client's default), then run `python -m orca_jax.client batch` on
6 prompts; report wall times, mean running batch and preemptions from /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

CHATS = ["Write a short poem about the sea.", "Explain what a hash table is.",
         "Give me three tips for learning to cook."]
BATCH_PROMPTS = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about autumn.", "Explain photosynthesis in one paragraph.",
                 "List five animals that live in the ocean.", "Why is the sky blue?"]
# (name, serve flags): ORCA's reservation with and without the server's max_tokens cap, and on demand.
CONFIGS = (
    ("reserve, no cap (issue 14's before)", ["--kv-allocation", "reserve", "--default-max-tokens", "0"]),
    ("reserve, cap 256", ["--kv-allocation", "reserve"]),
    ("on_demand, no cap", ["--kv-allocation", "on_demand", "--default-max-tokens", "0"]),
    ("on_demand, cap 256 (the default)", ["--kv-allocation", "on_demand"]),
)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^orca_jax:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def _mean_batch(a: str, b: str) -> float:
    count = _metric(b, "batch_size_count") - _metric(a, "batch_size_count")
    return round((_metric(b, "batch_size_sum") - _metric(a, "batch_size_sum")) / max(count, 1), 2)


async def _chats(url: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        async def one(prompt: str) -> dict:
            start = time.perf_counter()
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "temperature": 0})
            body = r.json()
            return {"seconds": time.perf_counter() - start, "tokens": body["usage"]["completion_tokens"],
                    "finish_reason": body["choices"][0]["finish_reason"]}
        return list(await asyncio.gather(*(one(p) for p in CHATS)))


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server not ready")


def run_config(name: str, flags: list[str], port: int, extra: list[str], with_batch: bool = True) -> dict:
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "orca_jax.serve", "--port", str(port), "--log-level",
                             "warning", *flags, *extra])
    try:
        _wait_ready(url, proc)
        before = httpx.get(url + "/metrics").text
        start = time.perf_counter()
        chats = asyncio.run(_chats(url))
        chats_s = time.perf_counter() - start
        middle = httpx.get(url + "/metrics").text
        if not with_batch:
            return {"config": name, "flags": flags, "chats_seconds": round(chats_s, 1), "chats": chats,
                    "chats_mean_batch": _mean_batch(before, middle),
                    "preemptions": _metric(middle, "num_preemptions_total")}
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(BATCH_PROMPTS) + "\n")
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "orca_jax.client", "--url", url, "batch", f.name,
                              "--no-progress", "--jsonl"], capture_output=True, text=True, timeout=1800)
        batch_s = time.perf_counter() - start
        after = httpx.get(url + "/metrics").text
        results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

        return {"config": name, "flags": flags, "chats_seconds": round(chats_s, 1), "chats": chats,
                "chats_mean_batch": _mean_batch(before, middle),
                "batch_seconds": round(batch_s, 1), "batch_ok": len(results), "batch_rc": out.returncode,
                "batch_mean_batch": _mean_batch(middle, after),
                "preemptions": _metric(after, "num_preemptions_total")}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main(argv: list[str] | None = None) -> None:
    import argparse
    p = argparse.ArgumentParser(prog="python -m orca_jax.bench.kv_modes", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the JSON rows here")
    p.add_argument("--configs", default=None, help="comma list of CONFIGS indices (default: all)")
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--chats-only", action="store_true", help="skip the 6-prompt client batch run")
    p.add_argument("serve_flags", nargs="*", help="more serve flags for every configuration (after --)")
    args = p.parse_args(argv)
    picked = CONFIGS if args.configs is None else [CONFIGS[int(i)] for i in args.configs.split(",")]
    rows = []
    for name, flags in picked:
        row = run_config(name, flags, args.port, args.serve_flags, with_batch=not args.chats_only)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
