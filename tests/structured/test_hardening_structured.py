"""Grammar work isolated and bounded: the sandbox's worker processes refuse what the library rejects,
crashes on or stalls in, and replace a worker that died; the engine takes grammars compiled off its
thread and compiles none itself; the limits reach every matcher."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest

from orca_jax import SamplingParams
from orca_jax.config import GrammarLimits
from orca_jax.structured import Constraint, ConstraintKind, GrammarCompiler, JsonOptions
from orca_jax.structured.sandbox import (GrammarRefused, GrammarSandbox, GrammarWorkersBusy, json_schema_constraint,
                                         kind_constraint, tool_calls_constraint)
from orca_jax.tokenizer import ByteTokenizer

from tests.helpers.engines import tiny_engine

TOKENIZER = ByteTokenizer(eos_token_ids=(2,), bos_token_id=1)
PLAIN = JsonOptions()


def _grammar(text: str):
    return functools.partial(kind_constraint, ConstraintKind.GRAMMAR, text, PLAIN)


def _chain(num_rules: int) -> str:
    return "start: r0\n" + "".join(f'r{k}: "x" r{k + 1}\n' for k in range(num_rules)) + f'r{num_rules}: "x"\n'


@pytest.fixture(scope="module")
def sandbox():
    box = GrammarSandbox(TOKENIZER, 256, num_workers=1, timeout_s=1.0)
    yield box
    box.close()


def test_what_compiles_passes_and_what_the_library_rejects_is_refused_with_its_reason(sandbox):
    sandbox.check(functools.partial(json_schema_constraint, {"type": "object"}, PLAIN))
    sandbox.check(functools.partial(tool_calls_constraint, [{"type": "function", "function": {"name": "f"}}],
                                    "required", "hermes", True))
    with pytest.raises(GrammarRefused, match="unclosed group"):
        sandbox.check(functools.partial(kind_constraint, ConstraintKind.REGEX, "a(b", PLAIN))
    with pytest.raises(GrammarRefused, match="at least one"):  # a Constraint's own checks run there too
        sandbox.check(functools.partial(kind_constraint, ConstraintKind.CHOICE, (), PLAIN))


def test_a_grammar_that_crashes_the_library_kills_only_its_worker(sandbox):
    sandbox.start()  # (when this test runs first)
    before = sandbox.worker_pids
    with pytest.raises(GrammarRefused, match=r"worker process died: killed by SIGSEGV"):
        sandbox.check(_grammar(_chain(3_000)))  # overflows llguidance's stack
    after = sandbox.worker_pids  # the worker and its spare
    assert sandbox.num_crashed == 1 and len(after) == len(before) == 2 and len(set(before) - set(after)) == 1
    sandbox.check(_grammar('start: "ok"'))  # the next one is served


def test_a_grammar_past_the_cpu_time_limit_is_refused_and_its_worker_replaced():
    """The limit is the worker's CPU time (the kernel ends it), however long a busy host takes to give
    it that: the clock's bound here is 10 minutes, and the verdict is the grammar's."""
    box = GrammarSandbox(TOKENIZER, 256, num_workers=1, timeout_s=0.5, wall_clock_s=600)
    try:
        with pytest.raises(GrammarRefused, match=r"did not compile within 0.5 s of CPU time \(the server's "
                                                 r"--grammar-timeout-s\)"):
            box.check(functools.partial(kind_constraint, ConstraintKind.CHOICE,
                                        tuple(f"option {k}" for k in range(100_000)), PLAIN))
        assert (box.num_timed_out, box.num_crashed, box.num_busy) == (1, 0, 0)
        box.check(_grammar('start: "ok"'))
    finally:
        box.close()


def test_a_worker_the_host_gives_no_cpu_is_the_servers_trouble_not_the_grammars():
    """A worker that cannot get its CPU time within the clock's bound (stopped here, as a starved one
    is in effect) answers GrammarWorkersBusy (503: retry), not a refusal of the grammar."""
    box = GrammarSandbox(TOKENIZER, 256, num_workers=1, timeout_s=0.2, wall_clock_s=1.0)
    try:
        box.check(_grammar('start: "ok"'))  # the worker is up
        stopped = box.worker_pids  # the worker and the spare
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        with pytest.raises(GrammarWorkersBusy, match="too busy to check the grammar"):
            box.check(_grammar('start: "ok"'))
        for pid in set(stopped) & set(box.worker_pids):  # the spare, now the worker
            os.kill(pid, signal.SIGCONT)
        assert (box.num_busy, box.num_timed_out, box.num_crashed) == (1, 0, 0)
        box.check(_grammar('start: "ok"'))
    finally:
        box.close()


def test_a_worker_killed_from_outside_is_the_servers_trouble_not_the_grammars():
    box = GrammarSandbox(TOKENIZER, 256, num_workers=1, timeout_s=60)
    try:
        box.check(_grammar('start: "ok"'))
        # The worker that will take the task: not the spare, whose own death is another case.
        busy = [pid for pid in box.worker_pids if pid != box._spare.pid]  # noqa: SLF001

        def kill_once_checking():  # the event: the task was handed to a worker (seconds of work follow)
            while box.num_checks < 2:
                time.sleep(0.005)
            for pid in busy:
                os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_checking)
        killer.start()
        with pytest.raises(GrammarWorkersBusy, match=r"stopped from outside \(SIGKILL"):
            box.check(functools.partial(kind_constraint, ConstraintKind.CHOICE,
                                        tuple(f"option {k}" for k in range(100_000)), PLAIN))
        killer.join()
        assert (box.num_busy, box.num_timed_out, box.num_crashed) == (1, 0, 0)
        box.check(_grammar('start: "ok"'))
    finally:
        box.close()


def test_the_engine_takes_a_compiled_grammar_and_compiles_nothing_itself():
    engine = tiny_engine(max_num_seqs=2, max_num_batched_tokens=16, num_pages=32)
    constraint = Constraint(ConstraintKind.REGEX, "[a-c]{4}")
    compiled = engine.grammar_compiler.compile(constraint)  # what a server does on its own threads
    compiles = engine.grammar_compiler.num_compiled
    engine.add_request([5, 6], SamplingParams(max_tokens=8, structured_outputs=constraint), request_id="r",
                       grammar=compiled)
    assert engine.grammar_compiler.num_compiled == compiles
    other = GrammarCompiler(TOKENIZER, 256).compile(constraint)
    with pytest.raises(ValueError, match="this engine's grammar compiler"):
        engine.add_request([5, 6], SamplingParams(max_tokens=8, structured_outputs=constraint), grammar=other)
    finals = {}
    while engine.has_unfinished():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    assert len(finals["r"].text) == 4 and set(finals["r"].text) <= set("abc")


def test_the_limits_bound_each_tokens_mask():
    engine = tiny_engine(max_num_seqs=2, max_num_batched_tokens=16, num_pages=32,
                         grammar_limits=GrammarLimits(max_items_in_row=20))
    tools = [{"type": "function", "function": {"name": f"f{k}"}} for k in range(30)]
    constraint = tool_calls_constraint(tools, "required", "hermes", True, TOKENIZER)
    engine.add_request([5, 6], SamplingParams(max_tokens=8, structured_outputs=constraint), request_id="r")
    finals = {}
    while engine.has_unfinished():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    assert finals["r"].finish_reason == "error" and "max is 20" in finals["r"].error.message
