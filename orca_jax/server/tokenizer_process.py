"""Large prompts tokenized in a process of their own, so that no size of prompt stalls the server.

The `tokenizers` library holds the GIL for most of an encode: measured with a byte-level BPE, a
600,000-character prompt kept the event loop of the server from answering /health for 1.1 s on a
busy 2-core machine, whichever thread did it. Texts of more than IN_PROCESS_CHARS characters (and
chats whose content has that many) are therefore encoded by a worker process holding a copy of the
tokenizer, at a lower priority than the server's threads; the rest (nearly all requests: ~50 ms of
GIL at that size) stay on the front end's threads, where a round trip would cost more than it saves.
Only ids a request can use come back: the worker raises TooManyTokensError without building the ids
of a longer text. The worker talks over its stdin and stdout (pickles, length-prefixed) and exits when
the server's end closes, so it never outlives the server, however that ends.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading

from orca_jax.tokenizer import BaseTokenizer
from orca_jax.worker_frames import read_frame, worker_stdio, write_frame

IN_PROCESS_CHARS = 100_000
# What a worker may be asked to run, by name.
_METHODS = {"encode": lambda tokenizer: tokenizer.encode, "encode_prompt": lambda tokenizer: tokenizer.encode_prompt,
            "encode_chat": lambda tokenizer: tokenizer.encode_chat}
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TokenizerProcessDied(RuntimeError):
    """The worker process died mid-request (the server's 503: the next request starts a new one)."""


class TokenizerProcess:
    """`tokenizer`'s encode, encode_prompt and encode_chat, run by a worker process (started on first
    use, or by start()), one call at a time. Blocking: call them from a thread. What the tokenizer
    raises is raised here."""

    def __init__(self, tokenizer: BaseTokenizer):
        # Pickled now, at the server's start: SmolLM2's takes ~0.1 s of GIL, which the first large
        # prompt's start of the worker would otherwise stall the event loop for.
        self._setup = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one call at a time; guards _process

    def start(self) -> None:
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._process is None or self._process.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
            self._process = subprocess.Popen([sys.executable, "-m", "orca_jax.server.tokenizer_process"], env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
            write_frame(self._process.stdin, self._setup)

    @property
    def pid(self) -> int | None:
        """The worker's process id (None before it starts or once closed)."""
        process = self._process
        return None if process is None else process.pid

    def encode(self, text: str, **kwargs) -> list[int]:
        return self._call("encode", (text,), kwargs)

    def encode_prompt(self, text: str, **kwargs) -> list[int]:
        return self._call("encode_prompt", (text,), kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self._call("encode_chat", (messages, add_generation_prompt), kwargs)

    def _call(self, method: str, args: tuple, kwargs: dict) -> list[int]:
        with self._lock:
            self._start()
            try:
                write_frame(self._process.stdin, pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))
                ok, value = pickle.loads(read_frame(self._process.stdout))
            except (OSError, EOFError):
                self._stop()
                raise TokenizerProcessDied("the tokenizer process died; retry the request") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop the worker (waits for a call in progress)."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # the worker's cue to exit
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            process.stdout.close()


def _serve(frames_in, frames_out) -> None:
    tokenizer = pickle.loads(read_frame(frames_in))
    while True:
        try:
            method, args, kwargs = pickle.loads(read_frame(frames_in))
        except EOFError:  # the server closed its end
            return
        try:
            if method not in _METHODS:
                raise ValueError(f"no tokenizer method {method!r}")
            reply = (True, _METHODS[method](tokenizer)(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - raised again in the server, as the tokenizer raised it
            reply = (False, error)
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - an exception that cannot be pickled: its message still can
            payload = pickle.dumps((False, ValueError(str(reply[1]))), protocol=pickle.HIGHEST_PROTOCOL)
        write_frame(frames_out, payload)


def _main() -> None:
    _serve(*worker_stdio())

if __name__ == "__main__":
    _main()
