"""`python -m orca_jax.client`: FineInfer-style command-line client of an orca_jax server.

  chat   interactive, streamed, history kept, sent with high priority (chat overtakes batch work
         when the server runs --scheduling-policy priority). Ctrl-C stops the reply under way and
         keeps the conversation; /reset clears the history, /exit or Ctrl-D quits.
  batch  a file of prompts (one per line, or JSONL objects with "prompt" or "messages" and any
         request fields), sent concurrently with low priority; each result is printed as it
         finishes, with its time to first token, total time and token count; a progress bar on a
         terminal, a summary at the end, and with --output all results as JSON lines.

Every request names max_tokens (--max-tokens), so none runs to the end of the context. Exit status:
0 when every request succeeded, 1 when one failed (or no server answers at --url, which is named),
2 for a bad argument or batch file.
Only httpx, tqdm and the standard library: no jax is imported.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import tqdm

from orca_jax.help_format import DefaultsHelpFormatter

CHAT_PRIORITY = 10
BATCH_PRIORITY = 0
MAX_RETRIES_WHEN_BUSY = 5
DEFAULT_MAX_TOKENS = 256


class ServerError(Exception):
    """The server answered with an error body."""


@dataclasses.dataclass(slots=True)
class Reply:
    text: str
    finish_reason: str | None
    completion_tokens: int
    seconds_to_first_token: float | None
    seconds: float


class Client:
    """Streams completions from one server; retries politely while it says it is busy (503)."""

    def __init__(self, http: httpx.AsyncClient, model: str | None):
        self.http = http
        self.model = model

    async def stream(self, path: str, body: dict, on_text: Callable[[str], None] | None = None) -> Reply:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            body.setdefault("model", self.model)
        for attempt in range(MAX_RETRIES_WHEN_BUSY + 1):
            try:
                return await self._stream_once(path, body, on_text)
            except httpx.TransportError as error:  # nothing answered: say where we looked
                raise ServerError(unreachable(self.http.base_url, error)) from None
            except _Busy as busy:
                if attempt == MAX_RETRIES_WHEN_BUSY:
                    raise ServerError(f"server still busy after {attempt + 1} tries") from None
                await asyncio.sleep(busy.retry_after)
        raise AssertionError("unreachable")

    async def _stream_once(self, path: str, body: dict, on_text: Callable[[str], None] | None) -> Reply:
        start = time.monotonic()
        first_token_at = None
        parts: list[str] = []
        finish_reason, completion_tokens = None, 0
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code == 503 and "retry-after" in response.headers:
                raise _Busy(float(response.headers["retry-after"]))
            if response.status_code != 200:
                await response.aread()
                raise ServerError(_error_message(response))
            async for event in _sse_events(response):
                if "error" in event:
                    raise ServerError(event["error"].get("message", "stream failed"))
                if event.get("usage"):
                    completion_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if text:
                        first_token_at = first_token_at or time.monotonic()
                        parts.append(text)
                        if on_text is not None:
                            on_text(text)
                    finish_reason = choice.get("finish_reason") or finish_reason
        ttft = first_token_at - start if first_token_at else None
        return Reply("".join(parts), finish_reason, completion_tokens, ttft, time.monotonic() - start)


class _Busy(Exception):
    def __init__(self, retry_after: float):
        super().__init__(retry_after)
        self.retry_after = retry_after


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


def unreachable(url, error: httpx.TransportError) -> str:
    return (f"cannot reach the server at {url} ({error or type(error).__name__}); is it running? "
            "(python -m orca_jax.serve)")


def _error_message(response: httpx.Response) -> str:
    try:
        return f"HTTP {response.status_code}: {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


# ---- chat mode ----------------------------------------------------------------------------------

def _write_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()  # streamed tokens should appear as they arrive, not at the next newline


def reply_or_interrupt(runner: asyncio.Runner, reply: Coroutine[Any, Any, Reply]) -> Reply | None:
    """Run one streamed reply to its end, or None when Ctrl-C stopped it.

    The runner turns Ctrl-C into a cancellation of `reply`, whose `async with` then closes the
    stream: the server sees the client leave and aborts the request. The session goes on.
    """
    try:
        return runner.run(reply)
    except KeyboardInterrupt:
        return None


def run_chat(runner: asyncio.Runner, client: Client, args: argparse.Namespace,
             read_line: Callable[[str], str] | None = None, write: Callable[[str], None] = _write_now) -> int:
    """Read-eval-print loop; each turn's reply streams to `write`, and Ctrl-C stops just that reply.
    Returns how many turns failed."""
    read_line = read_line or input  # looked up per call, so a replaced builtins.input is honoured
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    write("chat with the model; Ctrl-C stops a reply, /reset clears the history, /exit or Ctrl-D quits\n")
    failures = 0
    while True:
        try:
            line = read_line("you> ").strip()
        except (EOFError, KeyboardInterrupt):  # at the prompt, Ctrl-C quits as Ctrl-D does
            write("\n")
            return failures
        if line in ("/exit", "/quit"):
            return failures
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        write("assistant> ")
        body = {"messages": history, "priority": args.priority, "temperature": args.temperature,
                "max_tokens": args.max_tokens}
        shown: list[str] = []

        def show(text: str) -> None:
            shown.append(text)
            write(text)

        try:
            reply = reply_or_interrupt(runner, client.stream("/v1/chat/completions", body, on_text=show))
        except (ServerError, httpx.HTTPError) as error:
            history.pop()
            failures += 1
            write(f"\n[error: {error}]\n")
            continue
        if reply is None:
            # Keep what the user saw, so the next turn can refer to it; a reply cut before any
            # text leaves no turn behind (two user turns in a row would confuse the template).
            if shown:
                history.append({"role": "assistant", "content": "".join(shown)})
            else:
                history.pop()
            write("\n[stopped]\n")
            continue
        history.append({"role": "assistant", "content": reply.text})
        write(f"\n[{reply.completion_tokens} tokens, first after {_seconds(reply.seconds_to_first_token)}, "
              f"{reply.seconds:.2f}s, finish: {reply.finish_reason}]\n")


# ---- batch mode ---------------------------------------------------------------------------------

def read_batch(path: str) -> list[dict]:
    """Request bodies from a file: plain lines become chat messages, JSON objects pass through."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    bodies = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                body = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON: {error}") from None
            if "prompt" not in body and "messages" not in body:
                raise ValueError(f"{path}:{number}: a JSON line needs 'prompt' or 'messages'")
        else:
            body = {"messages": [{"role": "user", "content": line}]}
        bodies.append(body)
    return bodies


@dataclasses.dataclass(slots=True)
class BatchSummary:
    num_requests: int
    num_failed: int
    completion_tokens: int
    seconds: float

    def line(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (f"{self.num_requests} requests, {self.num_failed} failed, {self.completion_tokens} tokens "
                f"generated in {self.seconds:.2f}s ({rate:.1f} tokens/s)")


async def run_batch(client: Client, args: argparse.Namespace,
                    write: Callable[[str], None] = _write_now) -> BatchSummary:
    """Sends the prompts (at most args.concurrency at once), with a progress bar on a terminal.

    Each result is printed as it finishes; with --output, all of them are also written there as
    JSON lines in the file's order.
    """
    bodies = read_batch(args.file)
    results: list[dict] = [{} for _ in bodies]
    limit = asyncio.Semaphore(args.concurrency or len(bodies) or 1)
    progress = tqdm.tqdm(total=len(bodies), unit="req", file=sys.stderr, dynamic_ncols=True,
                         disable=args.no_progress or not sys.stderr.isatty())
    tokens = failures = 0
    start = time.monotonic()

    async def one(index: int, body: dict) -> None:
        nonlocal tokens, failures
        body = {"priority": args.priority, "temperature": args.temperature, "max_tokens": args.max_tokens,
                **body}
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        asked = _what_was_asked(body)
        async with limit:
            try:
                reply = await client.stream(path, body)
            except (ServerError, httpx.HTTPError) as error:
                reply, result = None, {"index": index, **asked, "error": str(error)}
            else:
                result = {"index": index, **asked, "text": reply.text, "finish_reason": reply.finish_reason,
                          "completion_tokens": reply.completion_tokens,
                          "seconds_to_first_token": reply.seconds_to_first_token, "seconds": reply.seconds}
        results[index] = result
        if reply is None:
            failures += 1
            line = f"[{index}] error: {result['error']}"
        else:
            tokens += reply.completion_tokens
            line = (f"[{index}] {reply.seconds:.2f}s (first token {_seconds(reply.seconds_to_first_token)}), "
                    f"{reply.completion_tokens} tokens, {reply.finish_reason}: {reply.text!r}")
        with progress.external_write_mode():  # the bar is redrawn below the line, not through it
            write((json.dumps(result) if args.jsonl else line) + "\n")
        progress.set_postfix(tokens=tokens, failed=failures, refresh=False)
        progress.update()

    try:
        await asyncio.gather(*(one(i, body) for i, body in enumerate(bodies)))
    finally:
        progress.close()
    summary = BatchSummary(len(bodies), failures, tokens, time.monotonic() - start)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(result) + "\n" for result in results)
    sys.stderr.write(summary.line() + (f"; results in {args.output}" if args.output else "") + "\n")
    return summary


def _what_was_asked(body: dict) -> dict:
    """The prompt a result answers: the prompt, or the last message's text (a plain line's); a chat
    of several messages keeps them all too."""
    if "prompt" in body:
        return {"prompt": body["prompt"]}
    messages = body["messages"]
    last = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
    return {"prompt": last, **({"messages": messages} if len(messages) > 1 else {})}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def build_parser() -> argparse.ArgumentParser:
    defaults = DefaultsHelpFormatter  # --help shows the URL it will call, and the rest
    p = argparse.ArgumentParser(prog="python -m orca_jax.client", description=__doc__.splitlines()[0],
                                formatter_class=defaults)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (`make serve`'s)")
    p.add_argument("--api-key", default=None, help="bearer key (or $ORCA_API_KEY)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    modes = p.add_subparsers(dest="mode", required=True)
    chat = modes.add_parser("chat", help="interactive streamed chat", formatter_class=defaults)
    chat.add_argument("--priority", type=int, default=CHAT_PRIORITY, help="higher runs first")
    chat.add_argument("--system", default=None, help="system prompt")
    batch = modes.add_parser("batch", help="send a file of prompts concurrently", formatter_class=defaults)
    batch.add_argument("file", help="one prompt per line, or JSONL request bodies")
    batch.add_argument("--priority", type=int, default=BATCH_PRIORITY, help="higher runs first")
    batch.add_argument("--jsonl", action="store_true", help="print results as JSON lines")
    batch.add_argument("-o", "--output", default=None, help="also write every result to this JSONL file")
    batch.add_argument("--concurrency", type=int, default=0, help="requests at once (0: all)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    for mode in (chat, batch):
        # Sent with every request: a server's own default may be the whole context.
        mode.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens per reply at most")
        mode.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    return p


def _http_client(args: argparse.Namespace) -> httpx.AsyncClient:
    api_key = args.api_key or os.environ.get("ORCA_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # Batch mode opens one connection per prompt; no pool limit, or prompts would queue client-side.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=20)
    return httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits)


async def _batch(args: argparse.Namespace) -> int:
    async with _http_client(args) as http:
        summary = await run_batch(Client(http, args.model), args)
    return 1 if summary.num_failed else 0


def _chat(args: argparse.Namespace) -> int:
    # One event loop for the whole session (the connection stays open between turns), entered once
    # per reply so that Ctrl-C can cancel just that reply.
    with asyncio.Runner() as runner:
        http = _http_client(args)
        try:
            try:  # before the first prompt: a session with no server ends here, naming where it looked
                runner.run(http.get("/health"))
            except httpx.TransportError as error:
                sys.stderr.write(f"error: {unreachable(args.url, error)}\n")
                return 1
            failures = run_chat(runner, Client(http, args.model), args)
        finally:
            runner.run(http.aclose())
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        sys.stderr.write("error: --max-tokens must be at least 1\n")
        return 2
    try:
        return _chat(args) if args.mode == "chat" else asyncio.run(_batch(args))
    except (OSError, ValueError) as error:  # unreadable batch file, bad JSONL
        sys.stderr.write(f"error: {error}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
