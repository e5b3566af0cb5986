"""`python -m orca_jax.serve` end to end on tiny-llama with the front-door flags at once: a --config
file under command-line flags, --dtype float16, an inline --chat-template, HTTPS, a root path, an
API key, CORS, --gpu-memory-utilization (no effect on CPU), request logging on and uvicorn's access
log off, and the KV pool capped at what --max-num-seqs x --max-model-len can use."""

import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.process import ROOT, OutputDrained, checkout_env, free_port
KEY = "sk-e2e"



def _certificate(directory: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return key, cert


def test_serve_with_the_front_door_flags(tmp_path):
    key, cert = _certificate(tmp_path)
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 4\nmax-num-batched-tokens: 16\nmax-model-len: 64\npage-size: 16\n"
                      "dtype: float32\nuvicorn-log-level: info\n")
    port = free_port()
    command = [sys.executable, "-m", "orca_jax.serve", "--config", str(config), "--model", "tiny-llama",
               "--port", str(port), "--max-num-seqs", "2", "--dtype", "float16",
               "--chat-template", "{{ messages[-1]['content'] }}", "--ssl-keyfile", str(key),
               "--ssl-certfile", str(cert), "--root-path", "/llm", "--api-key", KEY,
               "--allowed-origins", "https://app.example", "--gpu-memory-utilization", "0.5",
               "--disable-uvicorn-access-log", "--compilation-cache-dir", str(tmp_path / "xla")]
    process = OutputDrained(command, cwd=ROOT, env=checkout_env())
    url = f"https://127.0.0.1:{port}"
    tls = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 300
        lines = []
        while not any("ready at" in line for line in lines):  # logged once every program is compiled
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(process.readline())
        with httpx.Client(base_url=url, verify=tls, headers={"Authorization": f"Bearer {KEY}"}) as client:
            health = client.get("/health")
            chat = client.post("/v1/chat/completions", headers={"Origin": "https://app.example"},
                               json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                                     "temperature": 0})
            keyless = httpx.get(url + "/v1/models", verify=tls)
        process.send_signal(signal.SIGTERM)
        output = "".join(lines) + process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    ready = [line for line in output.splitlines() if "ready at" in line]
    assert len(ready) == 1 and ready[0].endswith(f"ready at {url}")
    assert health.status_code == 200 and keyless.status_code == 401
    assert chat.status_code == 200, chat.text
    assert chat.headers["access-control-allow-origin"] == "https://app.example"
    # The template renders the last message alone: 5 bytes, no control tokens.
    assert chat.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert "model: tiny-llama in float16, context 64 tokens" in output
    # 2 sequences x 4 pages of 16 tokens: the rest of the default 0.5 GiB could never be used.
    assert "KV pool: 8 pages x 16 tokens = 128 tokens for requests" in output
    request_lines = [line for line in output.splitlines() if "orca_jax.requests" in line]
    assert len(request_lines) == 1 and "chatcmpl-" in request_lines[0]
    assert '"POST /v1/chat/completions HTTP/1.1" 200' not in output  # no access log


@pytest.mark.slow
def test_serve_with_the_tool_call_and_logprob_flags(tmp_path):
    """--enable-auto-tool-choice --tool-call-parser hermes --max-logprobs 5 --max-stop-strings 2
    --enable-prompt-logprobs on tiny-llama: a forced call's arguments fit its tool, auto is accepted,
    top_logprobs above 5 is refused, as are 3 stop strings, prompt logprobs come back with no program
    compiled after start, and the tokenizer routes answer."""
    import json

    port = free_port()
    # A template that writes the tools' names: the byte template drops tools, which would then come as a
    # system message of instructions, ~600 byte tokens, past tiny-llama's 512.
    template = tmp_path / "tools.jinja"
    template.write_text("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
                        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    command = [sys.executable, "-m", "orca_jax.serve", "--model", "tiny-llama", "--port", str(port),
               "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "512", "--page-size", "16",
               "--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--max-logprobs", "5", "--max-stop-strings", "2",
               "--enable-prompt-logprobs",
               "--compilation-cache-dir", str(tmp_path / "xla")]
    process = OutputDrained(command, cwd=ROOT, env=checkout_env())
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"],
        "additionalProperties": False}}}
    chat = {"messages": [{"role": "user", "content": "pick"}], "temperature": 0}
    try:
        deadline = time.monotonic() + 300
        lines = []
        while not any("ready at" in line for line in lines):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            lines.append(process.readline())
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            forced = client.post("/v1/chat/completions", json={**chat, "tools": [tool], "tool_choice": "required",
                                                               "parallel_tool_calls": False, "max_tokens": 400})
            auto = client.post("/v1/chat/completions", json={**chat, "tools": [tool], "max_tokens": 4})
            top5 = client.post("/v1/chat/completions", json={**chat, "max_tokens": 2, "logprobs": True,
                                                             "top_logprobs": 5})
            top6 = client.post("/v1/chat/completions", json={**chat, "max_tokens": 2, "logprobs": True,
                                                             "top_logprobs": 6})
            prompt = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "prompt_logprobs": 5})
            stops = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "stop": ["a", "b", "c"]})
            tokens = client.post("/tokenize", json={"prompt": "hi"}).json()
            ping = client.get("/ping")
        process.send_signal(signal.SIGTERM)
        output = "".join(lines) + process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert forced.status_code == 200, forced.text
    choice = forced.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "pick"
    assert json.loads(call["function"]["arguments"])["side"] in ("left", "right")
    assert auto.status_code == 200, auto.text
    assert len(top5.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 5
    assert top6.status_code == 400 and top6.json()["error"]["param"] == "top_logprobs"
    assert tokens["tokens"] == [104, 105] and ping.status_code == 200
    assert stops.status_code == 400 and stops.json()["error"]["code"] == "too_many_stop_strings"
    positions = prompt.json()["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == 5 and all(len(p) in (5, 6) for p in positions[1:])
    compiled = [line for line in output.splitlines() if "PromptLogprobsKey" in line]
    assert len(compiled) == 6 and not any("on demand" in line for line in compiled)  # 16..512, all at start
