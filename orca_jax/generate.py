"""One-shot greedy generation: `python -m orca_jax.generate --model smollm2-135m "Once upon a time"`.

Runs one request through the engine (the same path as the server); the text goes to stdout as it
is generated, and nothing else does: timings and logs go to stderr, the logs only from --log-level
on (error by default, so the warnings about programs compiled on first use, as they are here, do
not interleave with the text on a terminal). A preset without a weights file runs on random weights.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from orca_jax.config import DTYPES, EngineConfig
from orca_jax.models import presets
from orca_jax.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("prompt", help="the prompt text (the user message with --chat)")
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"a preset ({presets.describe_presets()}) or a path to {presets.MODEL_FORMATS}")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="auto: the checkpoint's (a preset's own)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="error",
                        help="orca_jax's logs on stderr")
    args = parser.parse_args(argv)
    if (error := presets.model_source_error(args.model)) is not None:
        parser.error(error)
    # Logs to stderr: stdout carries the text alone.
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    dtype = None if args.dtype == "auto" else args.dtype

    from orca_jax.engine import Engine  # jax: after the flags are checked
    from orca_jax.models.loader import load_model

    start = time.perf_counter()
    loaded = load_model(args.model, dtype=dtype)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if loaded.params is None:
        print(f"note: {args.model} has no weights file; using random weights", file=sys.stderr)
    # One request meets few buckets: compile those on first use rather than all at start.
    engine = Engine(EngineConfig(model=args.model, dtype=dtype, precompile=False), loaded)

    tokenizer = engine.tokenizer
    prompt_ids = (tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
                  if args.chat else tokenizer.encode_prompt(args.prompt))
    max_tokens = min(args.max_tokens, engine.max_model_len - len(prompt_ids))
    if not args.chat:
        sys.stdout.write(args.prompt)
    start = time.perf_counter()
    token_times: list[float] = []
    engine.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens))
    while engine.has_unfinished():
        for out in engine.step():
            token_times += [time.perf_counter()] * len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    _report(len(prompt_ids), start, token_times)
    return 0


def _report(num_prompt_tokens: int, start: float, token_times: list[float]) -> None:
    total = token_times[-1] - start if token_times else 0.0
    line = f"{num_prompt_tokens} prompt tokens, {len(token_times)} generated in {total:.2f}s"
    if len(token_times) > 2:
        # From the second token on: the prefill and the decode step's compilation are behind us.
        rate = (len(token_times) - 2) / (token_times[-1] - token_times[1])
        line += f"; first token after {token_times[0] - start:.2f}s, then {rate:.1f} tokens/s"
    print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
