"""`bench multiturn`: a multi-turn chat trace with prefix caching on and off, side by side in one run.

--num-conversations chats share a --system-len token system prompt; each has --turns turns of
--user-len new tokens and --output-len generated ones (EOS ignored). The chats advance together:
turn t of every chat is sent once turn t-1 of every chat is back, its prompt the whole history (the
system prompt, every earlier message and reply) plus the new message. With the same shapes, a
no-sharing trace sends prompts of the same lengths made of fresh random tokens each (nothing to
reuse), and the ORCA trace (--num-prompts requests of the paper's lengths) runs as `throughput` runs
it. Each trace runs on an engine with caching on, then on one with caching off (built in turn, each
with the GPU to itself), and starts with an empty cache. Per turn: wall seconds, TTFT p50/p99,
prompt tokens fed and found cached, tokens computed; per trace the total.

--http also sends the chat trace through `python -m orca_jax.serve` (launched, caching on, then off;
completions with token-id prompts, streamed). A client sees text, not the ids of a reply, so over
HTTP each history carries a stand-in reply of --output-len random tokens (the same in both runs):
the reply's own pages then go uncached, unlike in process.

--data-parallel-size N also runs the chat trace in process on N engine replicas (LLM(data_parallel_size=N)'s
engine cores, each on its own GPUs, caching on), first, before this process takes a GPU: the prefix-cache
hit rate it keeps against one engine's (a chat's turns should find the replica that holds its history).

The issue's trace on llama-8b (64 chats, a 1,024-token system prompt, 4 turns of 128 + 128):
  python -m orca_jax.bench multiturn --model llama-8b --http --result-dir DIR
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import os
import time

import numpy as np

from orca_jax.bench import serve_client
from orca_jax.bench.datasets import DatasetName, add_dataset_arguments, lengths_from_args, make_trace
from orca_jax.bench.driver import run_trace
from orca_jax.bench.harness import (Results, add_engine_arguments, add_result_arguments, build_engine,
                                    engine_config, launched_server, serve_flags)
from orca_jax.bench.serve_client import BenchRequest, Endpoint, ServeBenchConfig
from orca_jax.bench.serve_stats import RequestRecord
from orca_jax.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--num-conversations", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=1024, help="tokens of the shared system prompt")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-len", type=int, default=128, help="new tokens of each user message")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens of each reply")
    parser.add_argument("--sections", default="chat,no-sharing,orca", help="comma list of chat, no-sharing, orca")
    parser.add_argument("--http", action="store_true", help="also the chat trace through a launched server")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="also the chat trace on this many engine replicas in process (caching on)")
    parser.add_argument("--port", type=int, default=8766)
    add_dataset_arguments(parser, lists=False, names=(DatasetName.UNIFORM,))  # the ORCA trace's
    add_result_arguments(parser)


class ChatTrace:
    """The trace's token ids, drawn once: the system prompt, every user message, stand-in replies."""

    def __init__(self, args: argparse.Namespace, vocab_size: int):
        rng = np.random.default_rng(args.seed)
        draw = lambda n: rng.integers(3, vocab_size, n).tolist()  # noqa: E731
        self.args = args
        self.system = draw(args.system_len)
        self.users = [[draw(args.user_len) for _ in range(args.num_conversations)] for _ in range(args.turns)]
        self.replies = [[draw(args.output_len) for _ in range(args.num_conversations)] for _ in range(args.turns)]
        self.vocab_size = vocab_size

    def prompt_len(self, turn: int) -> int:
        return self.args.system_len + turn * (self.args.user_len + self.args.output_len) + self.args.user_len

    def unshared(self, turn: int, chat: int) -> list[int]:
        """A prompt of turn's length that shares nothing (its own random tokens)."""
        rng = np.random.default_rng([self.args.seed, 7, turn, chat])
        return rng.integers(3, self.vocab_size, self.prompt_len(turn)).tolist()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def run_turns(engine, trace: ChatTrace, shared: bool, *, fresh: bool = False) -> dict:
    """The chats in process, turn by turn; shared: each prompt the history, else fresh tokens.
    `engine`: an Engine, or EngineReplicas with `fresh` (just built: nothing cached to forget)."""
    args = trace.args
    histories = [list(trace.system) for _ in range(args.num_conversations)]
    if not fresh:
        engine.reset_prefix_cache()
    turns, total_start = [], time.perf_counter()
    for turn in range(args.turns):
        prompts = []
        for chat in range(args.num_conversations):
            histories[chat] += trace.users[turn][chat]
            prompts.append(list(histories[chat]) if shared else trace.unshared(turn, chat))
        before = engine.stats()
        start = time.perf_counter()
        ids = [engine.add_request(p, SamplingParams(max_tokens=args.output_len, ignore_eos=True)) for p in prompts]
        index = {request_id: i for i, request_id in enumerate(ids)}
        first, outputs = {}, {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - start
                if out.finished:
                    outputs[out.request_id] = out.output_token_ids
        seconds = time.perf_counter() - start
        after = engine.stats()
        for request_id, tokens in outputs.items():
            histories[index[request_id]] += tokens
        ttft = list(first.values())
        turns.append({"turn": turn, "seconds": seconds, "ttft_p50_s": percentile(ttft, 50),
                      "ttft_p99_s": percentile(ttft, 99), "prompt_tokens": sum(map(len, prompts)),
                      "cached_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
                      "computed_tokens": after.scheduled_tokens_total - before.scheduled_tokens_total,
                      "generated_tokens": sum(map(len, outputs.values()))})
    return {"seconds": time.perf_counter() - total_start, "turns": turns,
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "cached_tokens": sum(t["cached_tokens"] for t in turns),
            "computed_tokens": sum(t["computed_tokens"] for t in turns)}


async def http_turns(base_url: str, model: str, trace: ChatTrace) -> dict:
    """The chat trace over HTTP: every chat's turn sent at once, turn after turn (stand-in replies)."""
    import aiohttp

    args = trace.args
    config = ServeBenchConfig(base_url=base_url, model=model, num_requests=args.num_conversations,
                              endpoint=Endpoint.COMPLETIONS, ignore_eos=True, vocab_size=trace.vocab_size)
    histories = [list(trace.system) for _ in range(args.num_conversations)]
    turns, total_start = [], time.perf_counter()
    async with aiohttp.ClientSession(read_bufsize=serve_client.READ_BUFFER_BYTES,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        for turn in range(args.turns):
            records = []
            start = time.perf_counter()
            sends = []
            for chat in range(args.num_conversations):
                histories[chat] += trace.users[turn][chat]
                record = RequestRecord(chat, 0.0, len(histories[chat]), args.output_len)
                records.append(record)
                request = BenchRequest(list(histories[chat]), args.output_len, len(histories[chat]))
                sends.append(serve_client.send_one(session, config, request, record, start))
            await asyncio.gather(*sends)
            for chat in range(args.num_conversations):
                histories[chat] += trace.replies[turn][chat]
            ok = [r for r in records if r.ok]
            ttft = [r.ttft for r in ok]
            turns.append({"turn": turn, "seconds": time.perf_counter() - start, "ttft_p50_s": percentile(ttft, 50),
                          "ttft_p99_s": percentile(ttft, 99), "errors": len(records) - len(ok),
                          "prompt_tokens": sum(r.prompt_len for r in records)})
    return {"seconds": time.perf_counter() - total_start, "turns": turns}


def _with_caching(args: argparse.Namespace, caching: bool) -> argparse.Namespace:
    changed = copy.copy(args)
    changed.enable_prefix_caching = caching
    return changed


def run(args: argparse.Namespace) -> Results:
    results = Results("multiturn", args, args.model)
    sections = set(args.sections.split(","))
    if args.http:  # first, before this process takes the GPU
        for caching in (True, False):
            flags = serve_flags(_with_caching(args, caching), args.port)
            log = os.path.join(args.result_dir, f"{args.model}_server_{caching}.log") if args.result_dir else None
            with launched_server(flags, args.port, log) as server:
                trace = ChatTrace(args, vocab_size=_vocab_size(args))
                run_http = asyncio.run(http_turns(server["base_url"], args.model, trace))
            results.section(f"http_caching_{'on' if caching else 'off'}", run_http)
            print(f"http, caching {'on' if caching else 'off'}: {run_http['seconds']:.2f} s", flush=True)
    if args.data_parallel_size > 1 and "chat" in sections:  # before this process takes a GPU: the replicas take theirs
        from orca_jax.engine.replicas import EngineReplicas, replica_builds
        from orca_jax.models.presets import REAL_WEIGHT_PRESETS

        if args.load_format == "dummy" and args.model in REAL_WEIGHT_PRESETS:
            raise SystemExit(f"--data-parallel-size: each replica loads {args.model} by its name, with its real "
                             f"weights, unlike this engine's random ones: pass --load-format auto")

        replicas = EngineReplicas(replica_builds(engine_config(_with_caching(args, True)), args.data_parallel_size))
        try:
            result = run_turns(replicas, ChatTrace(args, vocab_size=_vocab_size(args)), True, fresh=True)
        finally:
            replicas.shutdown()
        results.section(f"chat_dp{args.data_parallel_size}", result)
        print(f"chat on {args.data_parallel_size} replicas: {result['seconds']:.2f} s, {result['cached_tokens']:,} of "
              f"{result['prompt_tokens']:,} prompt tokens cached", flush=True)
    for caching in (True, False):
        engine = build_engine(_with_caching(args, caching))
        trace = ChatTrace(args, engine.model_config.vocab_size)
        label = "on" if caching else "off"
        for name, shared in (("chat", True), ("no-sharing", False)):
            if name in sections:
                result = run_turns(engine, trace, shared)
                results.section(f"{name}_caching_{label}", result)
                print(f"{name}, caching {label}: {result['seconds']:.2f} s, {result['cached_tokens']:,} of "
                      f"{result['prompt_tokens']:,} prompt tokens cached", flush=True)
        if "orca" in sections:
            orca = make_trace(DatasetName.UNIFORM, args.num_prompts, None, args.seed, lengths_from_args(args))
            runs = [run_trace(engine, orca, realtime=False).summary() for _ in range(2)]
            results.section(f"orca_caching_{label}", runs)
            print(f"orca, caching {label}: {runs[-1]['tokens_per_s']:,.0f} tok/s", flush=True)
        del engine
        gc.collect()
    results.section("summary", summary(results))
    return results


def _vocab_size(args: argparse.Namespace) -> int:
    from orca_jax.models.presets import get_preset

    return get_preset(args.model).vocab_size


def summary(result: dict) -> dict:
    """Caching on over off: time ratios per trace (greater than 1: caching saved time)."""
    out = {}
    for name in ("chat", "no-sharing", "http"):
        on, off = result.get(f"{name}_caching_on"), result.get(f"{name}_caching_off")
        if on and off:
            out[f"{name}_off_over_on"] = off["seconds"] / on["seconds"]
    on, off = result.get("orca_caching_on"), result.get("orca_caching_off")
    if on and off:
        out["orca_on_over_off"] = on[-1]["tokens_per_s"] / off[-1]["tokens_per_s"]
    one, several = result.get("chat_caching_on"), next((v for k, v in result.items() if k.startswith("chat_dp")), None)
    if one and several:  # the replicas' prefix-cache hit rate over one engine's
        out["dp_hit_rate_over_one"] = ((several["cached_tokens"] / several["prompt_tokens"])
                                       / (one["cached_tokens"] / one["prompt_tokens"]))
    return out


def tables(result: dict) -> dict[str, list[dict]]:
    rows = []
    for key in sorted(k for k in result if (k.endswith(("_caching_on", "_caching_off")) or k.startswith("chat_dp"))
                      and not k.startswith("orca")):
        for turn in result[key]["turns"]:
            rows.append({"trace": key, "turn": turn["turn"], "s": turn["seconds"], "ttft p50 s": turn["ttft_p50_s"],
                         "ttft p99 s": turn["ttft_p99_s"], "prompt tokens": turn["prompt_tokens"],
                         "cached": turn.get("cached_tokens"), "computed": turn.get("computed_tokens")})
    return {"turns": rows, "summary": [result.get("summary", {})]}
