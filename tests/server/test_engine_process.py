"""The engine core in its own process (`--engine-process`): what only that mode has to show.

A core that dies is noticed at once (503s with the cause, /health failing, the server exiting 1);
a client that hangs up frees its KV in the core; flags the mode does not serve are refused at start.
The server's ordinary behaviour in this mode is checked by test_api.py and test_engine.py, which run
their tests in both modes.
"""

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from orca_jax.server.app import create_app
from orca_jax.server.process_engine import ProcessEngine

from tests.helpers.process import ROOT, OutputDrained, TINY_SERVER, checkout_env, free_port, wait_healthy
from tests.helpers.server import FakeEngine, asgi_client, live_server, parse_sse, wait_until

STEP_SECONDS = 0.02
COMPILE_SECONDS = 3.0  # SlowCompiler's: a loop that waited for it would show a gap this long


class SlowToCompile(FakeEngine):
    """A fake whose three programs take 0.3 s each to "compile" (built in the core process)."""

    def precompile(self, progress=None):
        from orca_jax.worker.model_runner import PrecompileReport

        from orca_jax.worker.precompile_progress import PrecompilePhase, PrecompileProgress

        for done in range(1, 4):
            time.sleep(0.3)
            if progress is not None:
                progress(PrecompileProgress(PrecompilePhase.COMPILING, done, 3, 0.3 * done, ("forward", done)))
        return PrecompileReport(3, 0.9, 0.0)


class SlowCompiler:
    """A grammar compiler that takes 3 s per constraint (the core's own; the front end checks with a real one)."""

    vocab_size = 256

    def cached(self, constraint):
        return None

    def compile(self, constraint):
        time.sleep(COMPILE_SECONDS)
        return None  # FakeEngine takes any grammar and follows none


class SlowGrammars(FakeEngine):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.grammar_compiler = SlowCompiler()


def _fake_core(**kwargs) -> ProcessEngine:
    return ProcessEngine(functools.partial(FakeEngine, **{"step_seconds": STEP_SECONDS, "max_model_len": 512,
                                                          "num_pages": 1024, **kwargs}))


@pytest.mark.anyio
async def test_a_killed_core_gives_503s_with_the_cause_and_a_failing_health_at_once():
    failures = []
    core = _fake_core(step_seconds=0.2)  # the stream would run 300 x 0.2 s = 60 s: ending sooner, it was noticed
    core.on_failure = failures.append
    async with asgi_client(create_app(core, served_model_name="fake")) as client:
        assert (await client.get("/health")).status_code == 200
        streaming = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 300, "stream": True}))
        await wait_until(lambda: core.latest_stats.num_running == 1)
        os.kill(core.process.pid, signal.SIGKILL)
        response = await asyncio.wait_for(streaming, 30)
        events = parse_sse(response.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "service_unavailable_error"
        assert "engine core process died" in events[-2]["error"]["message"]
        health = await client.get("/health")
        assert health.status_code == 503 and "engine core process died" in health.json()["reason"]
        late = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert late.status_code == 503 and "engine core process died" in late.json()["error"]["message"]
        assert (await client.post("/reset_prefix_cache")).status_code == 503
    assert len(failures) == 1 and "exit code -9" in str(failures[0])


@pytest.mark.anyio
async def test_health_reports_the_cores_compile_progress_and_early_requests_wait_for_it():
    ready_when_called = []
    core = ProcessEngine(SlowToCompile, precompile=True,
                         on_ready=lambda: ready_when_called.append(core.readiness.ready))
    async with asgi_client(create_app(core, served_model_name="fake")) as client:
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "starting", health.json()
        early = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
        seen = []
        while (health := await client.get("/health")).status_code != 200:
            seen.append(health.json()["waiting_for"])
            await asyncio.sleep(0.05)
        assert "compiling programs: 1 of 3 done" in seen or "compiling programs: 2 of 3 done" in seen, seen
        assert (await early).json()["choices"][0]["text"] == "jk"  # queued behind the compilation, then served
    assert ready_when_called == [False]  # once, before readiness flipped


@pytest.mark.anyio
async def test_a_client_hanging_up_frees_its_kv_in_the_core():
    core = _fake_core(step_seconds=0.2)  # the request would run 60 s: freed within the wait, it was aborted
    with live_server(create_app(core, served_model_name="fake")) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"prompt": "hello", "max_tokens": 300, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                await wait_until(lambda: core.latest_stats.kv_pages_used > 0)
            await wait_until(lambda: core.latest_stats.kv_pages_used == 0 and core.latest_stats.num_running == 0
                             and core.num_in_flight == 0, timeout=30)
            assert (await client.get("/health")).status_code == 200
            # The core still serves: the next request runs to its end.
            done = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
            assert done.json()["choices"][0]["text"] == "bcd"


@pytest.mark.anyio
async def test_shutdown_ends_running_requests_as_abort_and_the_core_exits_zero():
    core = _fake_core()
    app = create_app(core, served_model_name="fake")
    async with asgi_client(app) as client:
        running = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 300}))
        await wait_until(lambda: core.latest_stats.num_running == 1)
        core.begin_shutdown()
        response = await asyncio.wait_for(running, 5)
        assert response.json()["choices"][0]["finish_reason"] == "abort"
        assert (await client.get("/health")).status_code == 503
    assert core.process.exitcode == 0 and core.error is None


@pytest.mark.anyio
async def test_a_grammar_compiling_in_the_core_does_not_stall_its_loop():
    core = ProcessEngine(functools.partial(SlowGrammars, step_seconds=STEP_SECONDS, max_model_len=512, num_pages=1024))
    with live_server(create_app(core, served_model_name="fake")) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            arrivals = []

            async def stream():
                body = {"prompt": "a", "max_tokens": 400, "stream": True}  # 8 s or more, past the answer below
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            arrivals.append(time.monotonic())

            streaming = asyncio.create_task(stream())
            await wait_until(lambda: len(arrivals) > 5)
            sent = time.monotonic()
            constrained = await client.post("/v1/completions", json={
                "prompt": "b", "max_tokens": 3, "structured_outputs": {"regex": "[a-z]+"}})
            answered = time.monotonic()
            await streaming
    assert constrained.status_code == 200 and constrained.json()["choices"][0]["text"] == "cde"
    assert answered - sent >= COMPILE_SECONDS  # it waited for its grammar...
    during = [t for t in arrivals if sent <= t <= answered]
    gaps = [b - a for a, b in zip(during, during[1:])]
    # ...while the other request's tokens kept coming (a busy host may delay some, never by the compile's 3 s)
    assert len(during) > 10 and max(gaps) < COMPILE_SECONDS / 2, gaps


def _serve(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = OutputDrained([sys.executable, "-m", "orca_jax.serve", *TINY_SERVER, "--port", str(port), *flags],
                            cwd=ROOT, env=checkout_env())
    return process, f"http://127.0.0.1:{port}"


def _core_pid(server_pid: int) -> int:
    """The engine core: the server's child that multiprocessing spawned (not its resource tracker)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if parent == server_pid and b"spawn_main" in command:
            return int(entry)
    raise AssertionError("no engine core process")


def test_serve_exits_one_within_seconds_when_its_core_is_killed():
    process, url = _serve("--engine-process")
    try:
        wait_healthy(url, process, timeout=600)  # bounds a hang; a busy host starts slowly
        body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 2:
                        os.kill(_core_pid(process.pid), signal.SIGKILL)
                        killed_at = time.monotonic()
        output, _ = process.communicate(timeout=30)
        exit_seconds = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, output
    assert exit_seconds < 20, output  # not uvicorn's 30 s graceful shutdown: the death is noticed at once
    assert events[-1] == "[DONE]" and "engine core process died" in json.loads(events[-2])["error"]["message"]
    assert "the engine loop failed" in output


@pytest.mark.parametrize("flags, message", [
    (["--enable-fine-tuning"], "fine-tuning jobs"),
])
def test_engine_process_refuses_what_it_does_not_serve_at_start(flags, message):
    process, _ = _serve("--engine-process", *flags)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert f"python -m orca_jax.serve: error: {message}" in output and "--no-engine-process" in output


def test_structured_outputs_are_compiled_and_followed_in_the_core():
    """The front end checks the constraint (its grammar workers, its compiler); the core compiles it
    again in its own and masks every token: the same greedy answer as the in-thread engine's."""
    from orca_jax.config import SchedulingPolicy
    from tests.helpers.engines import tiny_engine

    build = functools.partial(tiny_engine, page_size=16, max_num_seqs=8, max_num_batched_tokens=8,
                              scheduler_options=dict(policy=SchedulingPolicy.PRIORITY))
    bodies = [{"prompt": "pick", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}},
              {"prompt": "digits", "max_tokens": 8, "temperature": 0, "structured_outputs": {"regex": "[0-9]{3}"}},
              {"prompt": "bad", "max_tokens": 8, "structured_outputs": {"regex": "(unclosed"}}]
    answers = {}
    for mode, engine in (("thread", build()), ("process", ProcessEngine(build))):
        with live_server(create_app(engine, served_model_name="tiny")) as server:
            answers[mode] = [httpx.post(server.url + "/v1/completions", json=body, timeout=60) for body in bodies]
    for mode, (choice, regex, bad) in answers.items():
        assert choice.json()["choices"][0]["text"] in ("yes", "no"), (mode, choice.text)
        text = regex.json()["choices"][0]["text"]
        assert len(text) == 3 and text.isdigit(), (mode, text)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs", (mode, bad.text)
    assert [r.json()["choices"][0]["text"] for r in answers["process"][:2]] == \
        [r.json()["choices"][0]["text"] for r in answers["thread"][:2]]


def test_sigterm_to_the_whole_process_group_still_drains_and_exits_zero():
    """A supervisor that signals every process of the group (systemd's default, Ctrl-C in a terminal) must
    not kill the core under running requests: it leaves the signal to the server, which drains."""
    port = free_port()
    process = OutputDrained([sys.executable, "-m", "orca_jax.serve", *TINY_SERVER, "--port", str(port),
                             "--engine-process"], cwd=ROOT, env=checkout_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=600)  # bounds a hang; a busy host starts slowly
        body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 2:
                        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] in ("abort", "length")
    assert "engine core process died" not in output, output


def test_a_model_the_core_cannot_read_ends_the_start_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    process, _ = _serve("--engine-process", "--model", str(tmp_path))
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output
    assert output.strip().splitlines()[-1] == (f"python -m orca_jax.serve: error: {tmp_path}/config.json: architecture "
                                               "model_type None is not supported (supported: GPT2LMHeadModel, "
                                               "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"), output


class SlowToBuild(FakeEngine):
    """A fake that takes a minute to build, as a big model takes to load."""

    def __init__(self, **kwargs):
        time.sleep(60)
        super().__init__(**kwargs)


def test_a_core_still_loading_exits_when_its_server_is_killed():
    """While it loads or compiles the core reads no pipe: it watches its parent instead."""
    script = ("from tests.server.test_engine_process import SlowToBuild\n"
              "from orca_jax.server.process_engine import ProcessEngine\n"
              "if __name__ == '__main__':\n"
              "    ProcessEngine(SlowToBuild)\n")
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=checkout_env())
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                core = _core_pid(process.pid)
                break
            except AssertionError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.1)
        time.sleep(2)  # the core is in its build now (or about to be: it watches its parent either way)
        process.kill()
        process.wait(10)
        deadline = time.monotonic() + 30  # it looks every fraction of a second; a busy host may delay that
        while _state(core) not in ("Z", "gone"):
            assert time.monotonic() < deadline, "the engine core outlived its server"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()


def test_a_core_whose_server_is_killed_exits_with_it():
    process, url = _serve("--engine-process")
    try:
        wait_healthy(url, process, timeout=600)  # bounds a hang; a busy host starts slowly
        core = _core_pid(process.pid)
        process.kill()
        process.communicate(timeout=30)
        deadline = time.monotonic() + 30  # it looks every fraction of a second; a busy host may delay that
        while _state(core) not in ("Z", "gone"):
            assert time.monotonic() < deadline, "the engine core outlived its server"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
