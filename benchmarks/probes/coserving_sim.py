"""What issue 26's two targets need, priced without a GPU: a discrete-event model of the engine under
the bench's Poisson load, with a fine-tuning job beside it under the TPOT-SLO rule (finetune/deferral.py),
its constants the H100's measurements. It asks three questions:

1. time-sharing (today): whole 512-token micro steps stall the decode when every decoding request's
   slack covers one. Does a perfect engine reach the light rate's 50%? (the calibration row: the same
   rule measured by `bench finetune`)
2. holding admission: new arrivals reset the least slack to zero. Held until the job's next iteration
   (at most HOLD_S), they earn their slack in step with the rest, paid in TTFT. How much does that buy?
3. token-level co-serving: the training forward rides decode iterations in chunks of C tokens (the
   engine's measured ride, coserving_cost.json), allowed while every decoding request stays within
   the SLO; each 512 tokens' backward is then one stall of `backward_ms`, taken from slack as today's
   steps are. What backward time does the light rate's 50% need?

The model: an iteration decodes every running request and prefills up to max_num_batched_tokens of
new ones (chunked), in tau = a + b x decoding + c x prefilled ms (a, b from the decode alone at 16 and
48 requests, c from a 512-token ride); inputs and outputs uniform as the bench's. It leaves out the
host (async scheduling, the job's own turns) and iteration-time noise; the calibration row says how far
that puts it from the engine (at 4406aab: the light rate's share 0.376 simulated, 0.303 measured; the
medium's p99 TPOT x1.09 and x1.11). Means over SEEDS runs of DURATION_S seconds; no jax.

The answer (coserving_sim.json): holding admission buys 0.376 -> 0.428 at the light rate but makes
the medium's p99 TPOT x1.29 (a held group's prefill is one long iteration); co-serving with today's
29.1-ms backward keeps 0.435, with a 22-ms one 0.52, with a 15-ms one 0.66 (medium x1.13-1.15).
With the light rate's measured/simulated ratio, 50% needs a 512-token backward near 15 ms.

    python benchmarks/probes/coserving_sim.py   (coserving_sim.json, ~1 minute on a CPU)
"""
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "results", "h100")
SEEDS, DURATION_S, HOLD_S, STEP_TOKENS = 4, 15.0, 0.06, 512


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


cost = _load(os.path.join(HERE, "coserving_cost.json"))
bench = _load(os.path.join(RESULTS, "llama-8b_finetune.json"))
sizes = _load(os.path.join(HERE, "train_step_sizes.json"))["sizes"]
decode = cost["decode"]
PER_DECODE_S = (decode["48"]["alone_ms"] - decode["16"]["alone_ms"]) / 32 / 1e3  # b: per decoding request
BASE_S = decode["16"]["alone_ms"] / 1e3 - 16 * PER_DECODE_S  # a
PER_PREFILL_S = (decode["16"]["rides"]["512"]["ms"] - decode["16"]["alone_ms"]) / 512 / 1e3  # c
RIDE_S = {int(c): (r["ms"] - decode["16"]["alone_ms"]) / 1e3 for c, r in decode["16"]["rides"].items()}
FT = bench["finetune"]
SLO_S = FT["tpot_slo"]["1.2"]["tpot_slo_s"]
ALONE_TOK_S = FT["job_alone"]["tokens_per_s"]
light_run = FT["tpot_slo"]["1.2"]["runs"][0]
STEP_S = light_run["fine_tuning_beside_s"] / light_run["fine_tuning_beside"]  # one 512-token micro step beside
BACKWARD_S = sizes["512"]["backward_ms"] / 1e3
ARGS = bench["args"]
MAX_BATCHED = ARGS["max_num_batched_tokens"]


def iteration_s(decoding: int, prefilled: int) -> float:
    return BASE_S + PER_DECODE_S * decoding + PER_PREFILL_S * prefilled


def simulate(rate: float, seed: int, job: bool = True, policy: str = "time-shared", chunk: int = 0,
             backward_s: float = BACKWARD_S) -> dict:
    """One run: p99 TPOT (s) and the job's tokens/s as a share of its alone rate.
    policy: "time-shared" (today's rule), "hold" (admission held for the job's next step), "co-serving"."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * DURATION_S * 1.3) + 5))
    arrivals = arrivals[arrivals < DURATION_S]
    inputs = rng.integers(ARGS["uniform_input_range"][0], ARGS["uniform_input_range"][1] + 1, len(arrivals))
    outputs = rng.integers(ARGS["uniform_output_range"][0], ARGS["uniform_output_range"][1] + 1, len(arrivals))
    now, nxt, waiting, running, done = 0.0, 0, [], [], []
    trained = ridden = pending = 0  # tokens trained; forward tokens ridden; micro-batches awaiting their backward
    just_stepped = False
    while True:
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            waiting.append({"arrival": arrivals[nxt], "input": inputs[nxt], "output": outputs[nxt], "prefilled": 0,
                            "tokens": 0, "first": None, "last": None})
            nxt += 1
        training = job and now < DURATION_S
        if not running and not waiting:
            if nxt >= len(arrivals):
                break
            if training:  # idle: Deferred Continuous Batching runs the job (a pending backward first)
                now += backward_s if pending else STEP_S
                pending, trained = max(pending - 1, 0), trained + STEP_TOKENS
            else:
                now = arrivals[nxt]
            continue
        decoding = [r for r in running if r["first"] is not None]
        slack = min((SLO_S * (r["tokens"] - 1) - (now - r["first"]) for r in decoding), default=None)
        if training and slack is not None:
            stall = backward_s if policy == "co-serving" else STEP_S
            if (pending or policy != "co-serving") and slack >= stall:
                now, trained, just_stepped = now + stall, trained + STEP_TOKENS, True
                pending = max(pending - 1, 0)
                continue
        hold = (policy == "hold" and training and decoding and waiting and not just_stepped
                and slack is not None and (STEP_S - slack) / (SLO_S - iteration_s(len(decoding), 0))
                * iteration_s(len(decoding), 0) <= HOLD_S
                and now - min(w["arrival"] for w in waiting) + HOLD_S + STEP_S <= FT["fine_tuning"]["deferral_bound_s"])
        if not hold:
            running, waiting = running + waiting, []
        just_stepped = False
        budget, prefills = MAX_BATCHED - len(decoding), []
        for r in running:
            if r["prefilled"] < r["input"] and budget > 0:
                n = min(budget, r["input"] - r["prefilled"])
                budget -= n
                prefills.append((r, n))
        seconds = iteration_s(len(decoding), sum(n for _, n in prefills))
        if policy == "co-serving" and training and decoding and pending < 2:  # two micro-batches' activations
            if (slack or 0.0) + SLO_S - (seconds + RIDE_S[chunk]) >= 0:  # every request stays within its SLO
                seconds += RIDE_S[chunk]
                ridden += chunk
                pending, ridden = pending + ridden // STEP_TOKENS, ridden % STEP_TOKENS
        now += seconds
        for r, n in prefills:
            r["prefilled"] += n
        finished = []
        for r in running:
            if r["prefilled"] >= r["input"]:
                if r["first"] is None:
                    r["first"], r["tokens"] = now, 1
                elif all(r is not p for p, _ in prefills):
                    r["tokens"] += 1
                r["last"] = now
                if r["tokens"] >= r["output"]:
                    finished.append(r)
        for r in finished:
            running.remove(r)
            done.append(r)
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    ttft = [r["first"] - r["arrival"] for r in done]
    return {"tpot_p99_s": float(np.percentile(tpot, 99)), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "job_kept": trained / DURATION_S / ALONE_TOK_S}


def mean_over_seeds(fraction: float, **kwargs) -> dict:
    rate = fraction * FT["capacity_rps"]
    runs = [(simulate(rate, seed, **kwargs), simulate(rate, seed, job=False)) for seed in range(SEEDS)]
    return {"job_kept": float(np.mean([r["job_kept"] for r, _ in runs])),
            "tpot_p99_ratio": float(np.mean([r["tpot_p99_s"] / alone["tpot_p99_s"] for r, alone in runs])),
            "ttft_p50_s": float(np.mean([r["ttft_p50_s"] for r, _ in runs]))}


if __name__ == "__main__":
    fractions = [float(f) for f in ARGS["rate_fractions"].split(",")]
    rows = {"time-shared": {f: mean_over_seeds(f) for f in fractions},
            "hold": {f: mean_over_seeds(f, policy="hold") for f in fractions}}
    measured = {f: run["fine_tuning_tokens_per_s"] / ALONE_TOK_S for f, run in zip(fractions, FT["tpot_slo"]["1.2"]["runs"])}
    for backward_ms in (round(BACKWARD_S * 1e3, 1), 22.0, 15.0, 10.0):
        for chunk in (64, 128, 256):
            rows[f"co-serving C={chunk} backward={backward_ms}ms"] = {
                f: mean_over_seeds(f, policy="co-serving", chunk=chunk, backward_s=backward_ms / 1e3) for f in fractions}
    for name, row in rows.items():
        print(f"{name:40s}", "  ".join(f"{f}: kept {r['job_kept']:.3f} tpot99 x{r['tpot_p99_ratio']:.2f} "
                                       f"ttft50 {1e3 * r['ttft_p50_s']:.0f}ms" for f, r in row.items()))
    print("measured time-shared (bench finetune):", {f: round(k, 3) for f, k in measured.items()})
    result = {"what": __doc__.split("\n\n")[0], "constants": {
        "decode_base_ms": BASE_S * 1e3, "per_decode_ms": PER_DECODE_S * 1e3, "per_prefill_ms": PER_PREFILL_S * 1e3,
        "ride_ms": {c: s * 1e3 for c, s in RIDE_S.items()}, "tpot_slo_ms": SLO_S * 1e3, "step_beside_ms": STEP_S * 1e3,
        "backward_512_ms": BACKWARD_S * 1e3, "alone_tokens_per_s": ALONE_TOK_S, "hold_s": HOLD_S,
        "seeds": SEEDS, "duration_s": DURATION_S}, "rate_fractions": fractions,
        "measured_time_shared_kept": measured, "simulated": rows}
    with open(os.path.join(os.environ.get("OUT", HERE), "coserving_sim.json"), "w") as f:
        json.dump(result, f, indent=1)
