"""One-shot greedy generation: `python -m orca_jax.generate --model smollm2-135m "Once upon a time"`.

Runs the decoder directly on one sequence (no engine); the text goes to stdout, timings to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from orca_jax.models.greedy import greedy_stream
from orca_jax.models.loader import load_model
from orca_jax.tokenizer import StreamDecoder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the prompt text (the user message with --chat)")
    parser.add_argument("--model", default="smollm2-135m", help="preset name or model path")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if model.params is None:
        print(f"note: {args.model} has no weights file; using random weights", file=sys.stderr)
        from orca_jax.models.decoder import init_params
        model = dataclasses.replace(model, params=init_params(model.config))

    tokenizer = model.tokenizer
    text = (tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
            if args.chat else args.prompt)
    prompt_ids = tokenizer.encode(text)
    stream = StreamDecoder(tokenizer)
    if not args.chat:
        sys.stdout.write(args.prompt)
    start = time.perf_counter()
    token_times = []
    for token in greedy_stream(model.config, model.params, prompt_ids, args.max_tokens,
                               tokenizer.eos_token_ids):
        token_times.append(time.perf_counter())
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    _report(len(prompt_ids), start, token_times)


def _report(num_prompt_tokens: int, start: float, token_times: list[float]) -> None:
    total = token_times[-1] - start if token_times else 0.0
    line = f"{num_prompt_tokens} prompt tokens, {len(token_times)} generated in {total:.2f}s"
    if len(token_times) > 2:
        # From the second token on: the prefill and the decode step's compilation are behind us.
        rate = (len(token_times) - 2) / (token_times[-1] - token_times[1])
        line += f"; first token after {token_times[0] - start:.2f}s, then {rate:.1f} tokens/s"
    print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
