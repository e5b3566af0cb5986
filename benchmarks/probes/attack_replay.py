"""Issue 47's attacker cases (the HTTP front end's) replayed against a real `python -m orca_jax.serve`.

Starts a server from a checkout (its own, or --checkout DIR, e.g. main's for a "before"), with an API
key, LoRA and fine-tuning on, then sends each hostile request while a separate process polls /health
every 20 ms. Per case: the status codes, how many were 5xx, and the slowest /health answer while it
ran (a stalled event loop answers nothing). Ends with SIGTERM mid-stream: seconds past the grace period.

    python benchmarks/probes/attack_replay.py [--checkout /work/main] [--model tiny-llama] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "replay-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SIGTERM_WAIT_S = 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _poll_health(url: str, stop, out) -> None:
    """(sent, answered) of /health every 20 ms, on a connection of its own, until `stop` is set."""
    samples = []
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                client.get(url + "/health")
            except httpx.HTTPError:
                pass
            samples.append((sent, time.monotonic()))
            time.sleep(0.02)
    out.put(samples)


def _rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _adapter(path: str, value: float) -> str:
    """A tiny-llama peft adapter whose lora_B weights are all `value` (finite)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for layer in (0, 1):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = np.full((4, 64), 0.05, np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.full((64, 4), value, np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def _jsonl(size: int) -> bytes:
    line = json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 2,
                       "completion": " and runs away into the forest."}).encode() + b"\n"
    return line * (size // len(line))


def _nested_utf16(depth: int) -> bytes:
    return ('{"prompt": "a", "max_tokens": 1, "x": ' + "[" * depth + "]" * depth + "}").encode("utf-16")


def cases(url: str, workdir: str, server_pid: int):
    """(name, callable -> list of status codes, note) for each case."""
    big_prompt = "hello " * 330000

    def post(path, *, timeout=300, **kwargs):
        with httpx.Client(timeout=timeout) as client:
            return client.post(url + path, headers={**AUTH, **kwargs.pop("headers", {})}, **kwargs)

    def big_response():
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "n": 64, "logprobs": True,
                "top_logprobs": 20, "max_tokens": 128, "ignore_eos": True}
        answer = post("/v1/chat/completions", json=body)
        return [answer.status_code], f"{len(answer.content) / 1e6:.1f} MB"

    def prompt_to(path, field, prompt=big_prompt):
        def run():
            body = ({"prompt": prompt, "max_tokens": 1} if field == "prompt"
                    else {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
            return [post(path, json=body).status_code], f"{len(prompt) / 1e6:.1f} MB"
        return run

    def encodings():
        codes = []
        for encoding in ("utf-16", "utf-16-le", "utf-32", "utf-8-sig"):
            data = json.dumps({"prompt": "a", "max_tokens": 1}).encode(encoding)
            codes.append(post("/v1/completions", content=data, headers={"content-type": "application/json"}).status_code)
        for depth in (300, 450, 600):
            codes.append(post("/v1/completions", content=_nested_utf16(depth),
                              headers={"content-type": "application/json"}).status_code)
        return codes, "UTF-16/32/BOM bodies; UTF-16 nested 300-600"

    def surrogates():
        line = b'{"prompt": "a\\ud800", "completion": "b"}\n'
        codes = [post("/v1/files", files={"file": ("s.jsonl", line)}, data={"purpose": "fine-tune"}).status_code]
        answer = post("/v1/completions", content=b'{"\\ud800": 1, "prompt": "a", "max_tokens": 1}',
                      headers={"content-type": "application/json"})
        codes.append(answer.status_code)
        return codes, "key: " + answer.json().get("error", {}).get("message", "")[:70]

    def overflowing_adapters():
        codes = []
        for i, value in enumerate((1e19, 7.5e37)):
            path = _adapter(os.path.join(workdir, f"overflow{i}"), value)
            codes.append(post("/v1/load_lora_adapter", json={"lora_name": f"over{i}", "lora_path": path}).status_code)
            if codes[-1] == 200:
                codes.append(post("/v1/completions", json={"model": f"over{i}", "prompt": "hi",
                                                           "max_tokens": 4}).status_code)
        return codes, "B = 1e19, 7.5e37"

    def upload(size, leave_early=False):
        def run():
            data = _jsonl(size)
            before = _rss_mib(server_pid)[0]
            start = time.monotonic()
            if leave_early:
                try:
                    post("/v1/files", files={"file": ("big.jsonl", data)}, data={"purpose": "fine-tune"}, timeout=3)
                    code = 200
                except httpx.TimeoutException:
                    code = 0  # we left
                time.sleep(5)  # what the server does meanwhile counts against this case
                return [code], f"left after 3 s; RSS {before:.0f} -> {_rss_mib(server_pid)[0]:.0f} MiB"
            try:
                code = post("/v1/files", files={"file": ("big.jsonl", data)}, data={"purpose": "fine-tune"},
                            timeout=300).status_code
            except httpx.TimeoutException:
                code = 0
            rss = _rss_mib(server_pid)[0]
            return [code], f"{len(data) / 1e6:.0f} MB in {time.monotonic() - start:.1f} s; RSS {before:.0f} -> {rss:.0f} MiB"
        return run

    def small_items():
        codes = []
        for name in ("../../etc", "a\x00b", "a\nb"):
            codes.append(post("/v1/load_lora_adapter", json={"lora_name": name,
                                                            "lora_path": os.path.join(workdir, "overflow0")}).status_code)
        with httpx.Client(timeout=30) as client:
            request = client.build_request("GET", url + "/v1/models",
                                           headers=[("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")])
            codes.append(client.send(request).status_code)
        file_id = post("/v1/files", files={"file": ("ok.jsonl", _jsonl(200))}, data={"purpose": "fine-tune"}).json().get("id")
        codes.append(post("/v1/fine_tuning/jobs", json={"model": "tiny-llama", "training_file": file_id,
                                                        "hyperparameters": {"learning_rate_multiplier": "1"}}).status_code)
        return codes, "adapter names x3, duplicate Authorization, lr multiplier \"1\" (want all 4xx)"

    return [("13 MB chat response", big_response, 2),
            ("1.9 MB prompt /v1/completions", prompt_to("/v1/completions", "prompt"), 1),
            ("1.9 MB prompt /v1/chat/completions", prompt_to("/v1/chat/completions", "messages"), 1),
            ("1.9 MB prompt /tokenize", prompt_to("/tokenize", "prompt"), 1),
            # Under SmolLM2's bound (8192 x 81 characters): tokenized, then refused for its 200,000 tokens.
            ("0.6 MB prompt /v1/completions", prompt_to("/v1/completions", "prompt", "hello " * 100_000), 1),
            ("non-UTF-8 and nested bodies", encodings, 1),
            ("lone surrogates (upload line, key)", surrogates, 1),
            ("overflowing adapters", overflowing_adapters, 1),
            ("50 MB upload", upload(50 * 10**6), 1),
            ("50 MB upload, client leaves", upload(50 * 10**6, leave_early=True), 1),
            ("smaller items", small_items, 1)]


def sigterm_seconds(url: str, process: subprocess.Popen) -> float:
    """SIGTERM while a stream runs (grace period 0): seconds until the process exits."""
    body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                break
    try:
        process.wait(timeout=SIGTERM_WAIT_S)
    except subprocess.TimeoutExpired:
        return float("inf")
    return time.monotonic() - signalled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", default=HERE, help="the orca_jax checkout to serve (default: this one)")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--only", default=None, help="run the cases whose name contains one of these (comma-separated)")
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    workdir = tempfile.mkdtemp(prefix="attack_replay_")
    command = [sys.executable, "-m", "orca_jax.serve", "--model", args.model, "--port", str(port),
               "--api-key", KEY, "--enable-lora", "--max-lora-rank", "8", "--enable-fine-tuning",
               "--fine-tuning-dir", os.path.join(workdir, "ft"), "--max-num-seqs", "64",
               "--disable-log-requests", "--disable-uvicorn-access-log"]
    env = {**os.environ, "PYTHONPATH": args.checkout}
    log_path = os.path.join(workdir, "server.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=args.checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    results = []
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, open(log_path).read()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        stop, out = multiprocessing.Event(), multiprocessing.Queue()
        poller = multiprocessing.Process(target=_poll_health, args=(url, stop, out), daemon=True)
        poller.start()
        time.sleep(1)
        windows = []
        for name, run, repeats in cases(url, workdir, process.pid):
            if args.only and not any(part in name for part in args.only.split(",")):
                continue
            start = time.monotonic()
            codes, note = [], ""
            for _ in range(repeats if name.startswith("13 MB") else 1):
                got, note = run()
                codes += got
            windows.append((name, start, time.monotonic(), codes, note))
            time.sleep(0.5)
        stop.set()
        samples = out.get(timeout=60)
        poller.join()
        for name, start, end, codes, note in windows:
            stalls = [answered - sent for sent, answered in samples if answered >= start and sent <= end]
            results.append({"case": name, "codes": codes, "5xx": sum(c >= 500 for c in codes),
                            "health_max_s": round(max(stalls, default=float("nan")), 3), "note": note})
        print(f"{'case':40s} {'5xx':>4s} {'/health max s':>14s}  codes  note")
        for r in results:
            print(f"{r['case']:40s} {r['5xx']:4d} {r['health_max_s']:14.3f}  {r['codes']}  {r['note']}", flush=True)
        grace_exit = None if args.only else sigterm_seconds(url, process)
        if grace_exit is not None:
                print(f"SIGTERM mid-stream (grace 0): exited after {grace_exit:.2f} s (inf: not within "
                  f"{SIGTERM_WAIT_S} s), status {process.poll()}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    server_log = open(log_path).read()
    print(f"server log: {server_log.count('Traceback')} tracebacks, {len(server_log.splitlines())} lines ({log_path})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkout": args.checkout, "model": args.model, "cases": results,
                       "sigterm_exit_s": grace_exit, "tracebacks": server_log.count("Traceback")}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
