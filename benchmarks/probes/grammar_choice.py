"""Which grammar library backs structured outputs: llguidance, xgrammar and outlines-core side by side.

For each library and three vocabularies (SmolLM2's 49,152 byte-level BPE; a 128,256-token byte-level
BPE trained here on the venv's own text, Llama 3's size; the random-weight presets' ByteTokenizer
padded to 128,256 ids, of which only 0..255 have bytes) it measures: building the library's
tokenizer description, compiling each constraint (JSON schemas, a regex, a choice, a tool-call
grammar), and per step of a random walk (only allowed tokens, seeded) the host time of filling one
packed bitmask row and of accepting the sampled token. It also counts tokens without bytes that a
mask ever allows (they can never be part of a match).

    PYTHONPATH=.:<dir with the three libraries> python benchmarks/probes/grammar_choice.py \
        [--out benchmarks/probes/grammar_choice.json] [--walks 3] [--steps 200]

xgrammar and outlines-core are not project dependencies: install them into a side directory
(`pip install --no-deps --target DIR xgrammar==0.2.8 apache-tvm-ffi outlines-core==0.2.14`).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import time

import numpy as np

from orca_jax.models.loader import smollm2_gguf_path
from orca_jax.tokenizer import ByteTokenizer, Tokenizer

VOCAB_128K = 128_256
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "required": ["id", "owner", "tags", "status"], "properties": {
        "id": {"type": "integer", "minimum": 0},
        "owner": {"type": "object", "required": ["name", "address"], "properties": {
            "name": {"type": "string", "maxLength": 40},
            "address": {"type": "object", "required": ["city", "zip"], "properties": {
                "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "status": {"enum": ["open", "closed", "pending"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
        "type": "object", "required": ["sku", "qty", "price"], "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number"}, "gift": {"type": "boolean"}}}},
    "json_object": {"type": "object"},
}
TOOL_CALL = {"type": "object", "required": ["name", "arguments"], "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "required": ["city"], "additionalProperties": False, "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( \(ext\. [0-9]{1,4}\))?"
CHOICE = ["positive", "negative", "neutral", "mixed feelings"]
STRUCTURAL = frozenset(b'"{}[],:')


def vocabularies():
    """(name, token_bytes list, special ids, eos ids, encode) for the three vocabularies."""
    smol = Tokenizer.from_gguf(smollm2_gguf_path())
    yield "smollm2_49152", smol
    yield "bpe_128256", _trained_bpe()
    yield "bytes_128256", ByteTokenizer(eos_token_ids=(VOCAB_128K - 1,))


def _trained_bpe() -> Tokenizer:
    """A byte-level BPE of Llama 3's size, trained on the text files of this venv (deterministic)."""
    import sysconfig

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = sysconfig.get_paths()["purelib"]
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                   if f.endswith((".py", ".md", ".txt", ".rst")))
    chosen, budget = [], 60 << 20
    for path in files:
        if budget <= 0:
            break
        size = os.path.getsize(path)
        if size < 2_000_000:
            chosen.append(path)
            budget -= size

    def texts():
        for path in chosen:
            with open(path, encoding="utf-8", errors="ignore") as f:
                yield f.read()

    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>"
                                                          for i in range(254)]
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=VOCAB_128K, min_frequency=2, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(backend, chat_template=None, bos_token_id=0, eos_token_ids=(1,), source="bpe_128256")


def token_table(tokenizer, vocab_size):
    """bytes per id (b'' for ids the tokenizer has no bytes for) and the special ids."""
    real = tokenizer.vocab_size
    table = [tokenizer.token_bytes(i) if i < real else b"" for i in range(vocab_size)]
    specials = [i for i in range(min(real, vocab_size)) if tokenizer.is_special(i)]
    return table, specials


# --- one adapter per library: setup(), compile(kind, spec) -> matcher, fill(matcher, row), accept ---
class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, table, specials, vocab_size):
        import llguidance

        self.llg = llguidance
        eos = list(tokenizer.eos_token_ids)

        class Wrapper:
            eos_token_id, bos_token_id = eos[0], tokenizer.bos_token_id
            tokens, special_token_ids = table, specials

            def __call__(self, data: bytes):
                return tokenizer.encode(data.decode("utf-8", errors="replace"))

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapper()), eos_token=eos)

    def compile(self, kind, spec):
        LLMatcher = self.llg.LLMatcher
        grammar = {"json": lambda: LLMatcher.grammar_from_json_schema(spec),
                   "regex": lambda: LLMatcher.grammar_from_regex(spec),
                   "choice": lambda: LLMatcher.grammar_from_lark(
                       "start: " + " | ".join(json.dumps(c) for c in spec)),
                   "grammar": lambda: LLMatcher.grammar_from_lark(
                       'start: "<tool_call>\\n" %json ' + json.dumps(spec) + ' "\\n</tool_call>"')}[kind]()
        matcher = LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, matcher, row):
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, matcher, token):
        return matcher.consume_token(token)

    def done(self, matcher):
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, table, specials, vocab_size):
        import xgrammar

        self.xgr = xgrammar
        # xgrammar treats tokens that decode to b'' as special (never allowed); a special token's text
        # would otherwise match as plain text.
        raw = [b"" if i in set(specials) else b for i, b in enumerate(table)]
        self.info = xgrammar.TokenizerInfo(raw, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                           stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, kind, spec):
        xgr, c = self.xgr, self.compiler
        if kind == "json":
            compiled = c.compile_json_schema(json.dumps(spec), any_whitespace=True)
        elif kind == "regex":
            compiled = c.compile_regex(spec)
        elif kind == "choice":
            compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        else:
            compiled = c.compile_grammar(xgr.Grammar.concat(
                xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
                xgr.Grammar.from_json_schema(json.dumps(spec), any_whitespace=True),
                xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"')))
        return xgr.GrammarMatcher(compiled)

    def fill(self, matcher, row):
        matcher.fill_next_token_bitmask(row[None], 0)

    def accept(self, matcher, token):
        return matcher.accept_token(token)

    def done(self, matcher):
        return matcher.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, table, specials, vocab_size):
        import outlines_core

        self.oc = outlines_core
        eos = tokenizer.eos_token_ids[0]  # one EOS id only
        skip = set(specials) | set(tokenizer.eos_token_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(table):
            if b and i not in skip:  # ids left out of the map are never allowed
                by_bytes.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, kind, spec):
        if kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
        elif kind == "regex":
            regex = spec
        elif kind == "choice":
            regex = "|".join(re.escape(s) for s in spec)
        else:
            raise NotImplementedError("outlines-core has no context-free grammars (regex only)")
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def fill(self, matcher, row):
        matcher.write_mask_into(row.ctypes.data, row.size, 4)

    def accept(self, matcher, token):
        if token == self.vocab.get_eos_token_id():  # EOS is allowed in final states, not advanced on
            return matcher.is_finished()
        matcher.advance(token)
        return True

    def done(self, matcher):
        return matcher.is_finished()


def walk(lib, matcher, vocab_size, eos_ids, rng, steps, row):
    """Sample only allowed tokens for up to `steps` steps; per-step fill and accept seconds."""
    fills, accepts, text_ids, wild = [], [], [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill(matcher, row)
        fills.append(time.perf_counter() - t0)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])
        if allowed.size == 0:
            break
        wild += int(np.count_nonzero(~np.isin(allowed, eos_ids) & (allowed >= lib.real_vocab)))
        if np.isin(allowed, eos_ids).any() and rng.random() < 0.5:
            token = int(eos_ids[0])
        else:
            weights = lib.structural_weight[allowed]
            token = int(rng.choice(allowed, p=weights / weights.sum()))
        t0 = time.perf_counter()
        ok = lib.accept(matcher, token)
        accepts.append(time.perf_counter() - t0)
        assert ok, (lib.name, token)
        if token in eos_ids:
            break
        text_ids.append(token)
    return fills, accepts, text_ids, wild


def batch_fill(vocab_name, tokenizer, vocab_size, num_rows, num_steps=40):
    """The engine's path: orca_jax.structured fills `num_rows` rows of the nested schema at once
    (llguidance's thread pool, off the GIL), then every row takes its next token, for `num_steps`
    steps; the rows follow one walk, each from a different point of it."""
    from orca_jax.structured import Constraint, GrammarCompiler
    from orca_jax.structured.bitmask import allocate_token_bitmask, allowed_token_ids

    compiler = GrammarCompiler(tokenizer, vocab_size)
    constraint = Constraint.json_schema(SCHEMAS["nested"])
    walker, rng, ids = compiler.matcher(constraint), np.random.default_rng(0), []
    row = np.empty(compiler.bitmask_width, np.int32)
    weights = np.asarray([1.0 + 200.0 * any(c in STRUCTURAL for c in tokenizer.token_bytes(i))
                          if i < tokenizer.vocab_size else 1.0 for i in range(vocab_size)])
    while len(ids) < 400 and not walker.is_terminated():
        walker.fill_bitmask(row)
        allowed = [t for t in allowed_token_ids(row, vocab_size) if t not in compiler.eos_token_ids]
        if not allowed:
            break
        p = weights[allowed] / weights[allowed].sum()
        ids.append(int(rng.choice(allowed, p=p)))
        assert walker.accept(ids[-1])
    steps = min(num_steps, len(ids) // 2)
    starts = [(len(ids) - steps) * i // num_rows for i in range(num_rows)]
    matchers = [compiler.matcher(constraint, ids[:start]) for start in starts]
    bitmask = allocate_token_bitmask(num_rows, vocab_size)
    fills, accepts = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        compiler.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bitmask)
        t1 = time.perf_counter()
        for matcher, start in zip(matchers, starts):
            assert matcher.accept(ids[start + step])
        fills.append(t1 - t0)
        accepts.append(time.perf_counter() - t1)
    return {"vocab": vocab_name, "case": "json:nested", "rows": num_rows, "steps": steps,
            "cpus": os.cpu_count(), "fill_p50_ms": round(float(np.percentile(fills, 50)) * 1e3, 3),
            "fill_p99_ms": round(float(np.percentile(fills, 99)) * 1e3, 3),
            "accept_all_p50_ms": round(float(np.percentile(accepts, 50)) * 1e3, 3)}


def cases():
    for name, schema in SCHEMAS.items():
        yield f"json:{name}", "json", schema
    yield "regex:phone", "regex", REGEX
    yield "choice:sentiment", "choice", CHOICE
    yield "grammar:hermes_tool_call", "grammar", TOOL_CALL


def pct(values, q):
    return round(float(np.percentile(np.asarray(values) * 1e6, q)), 1) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/probes/grammar_choice.json")
    parser.add_argument("--walks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--libs", default="llguidance,xgrammar,outlines-core")
    parser.add_argument("--batch", type=int, default=64, help="rows of one parallel llguidance fill")
    args = parser.parse_args()
    libs = {cls.name: cls for cls in (Llguidance, Xgrammar, OutlinesCore)}
    rows, batches = [], []
    for vocab_name, tokenizer in vocabularies():
        vocab_size = max(tokenizer.vocab_size, VOCAB_128K if "128256" in vocab_name else 0)
        table, specials = token_table(tokenizer, vocab_size)
        eos_ids = np.asarray(tokenizer.eos_token_ids)
        structural = np.asarray([1.0 + 200.0 * any(c in STRUCTURAL for c in b) for b in table])
        for lib_name in args.libs.split(","):
            t0 = time.perf_counter()
            try:
                lib = libs[lib_name](tokenizer, table, specials, vocab_size)
            except Exception as err:  # a library that cannot take this vocabulary is a result
                rows.append({"vocab": vocab_name, "library": lib_name, "error": repr(err)})
                continue
            setup_s = time.perf_counter() - t0
            lib.real_vocab, lib.structural_weight = tokenizer.vocab_size, structural
            for case, kind, spec in cases():
                row = {"vocab": vocab_name, "vocab_size": vocab_size, "library": lib_name,
                       "tokenizer_setup_s": round(setup_s, 3), "case": case}
                try:
                    t0 = time.perf_counter()
                    lib.compile(kind, spec)
                    row["compile_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
                except NotImplementedError as err:
                    row["unsupported"] = str(err)
                    rows.append(row)
                    continue
                bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)
                fills, accepts, firsts, lengths, wild, ends = [], [], [], [], 0, 0
                for seed in range(args.walks):
                    matcher = lib.compile(kind, spec)
                    f, a, ids, w = walk(lib, matcher, vocab_size, eos_ids, np.random.default_rng(seed),
                                        args.steps, bitmask[0])
                    firsts.append(f[0])
                    fills += f[1:]
                    accepts += a
                    lengths.append(len(ids))
                    wild += w
                    ends += lib.done(matcher)
                row.update(first_mask_us=pct(firsts, 50), mask_p50_us=pct(fills, 50),
                           mask_p99_us=pct(fills, 99), mask_max_us=pct(fills, 100),
                           accept_p50_us=pct(accepts, 50), accept_p99_us=pct(accepts, 99),
                           steps=len(fills) + len(firsts), walks_ended=ends, walk_lengths=lengths,
                           byteless_tokens_allowed=wild)
                print(json.dumps(row), flush=True)
                rows.append(row)
        batches.append(batch_fill(vocab_name, tokenizer, vocab_size, args.batch))
        print(json.dumps(batches[-1]), flush=True)
    versions = {}
    for dist in ("llguidance", "xgrammar", "outlines-core"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    result = {"device": "CPU (2 cores shared with other sessions; one thread per mask), Python 3.11",
              "command": "PYTHONPATH=.:<libs> python benchmarks/probes/grammar_choice.py "
                         f"--walks {args.walks} --steps {args.steps}",
              "versions": versions, "rows": rows, "llguidance_batches": batches}
    if os.path.exists(args.out):  # keep the hand-written parts (wheels, dependencies, decision)
        with open(args.out, encoding="utf-8") as f:
            result = {**json.load(f), **result}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
