"""What issue 26's two targets need, priced without a GPU: a discrete-event model of the engine under
the bench's Poisson load, with a fine-tuning job beside it under the TPOT-SLO rule (finetune/deferral.py),
its constants the H100's measurements. It asks:

1. time-sharing (today): whole micro steps stall the decode when every decoding request's slack covers
   one. How close does it come to the light rate's 50%, with 512- or 256-token micro steps, and with a
   faster backward? (the calibration row: the same rule measured by `bench finetune`)
2. holding admission: new arrivals reset the least slack to zero. Held while the job's next step is
   predicted within HOLD_S (re-decided each iteration, within the deferral bound), they earn their
   slack in step with the rest, paid in TTFT. How much does that buy?
3. token-level co-serving: the training forward rides decode iterations in chunks of C tokens, allowed
   while every decoding request stays within the SLO; each 512 tokens' backward is then one stall of
   `backward_ms`, gated on slack as today's steps are. What backward time does the light rate's 50%
   need, and how much of that is co-serving's rather than the faster backward's?

The model: an iteration decodes every running request and prefills up to max_num_batched_tokens of
new ones (chunked), in tau = a + b x decoding + c x prefilled ms (a, b from the decode alone at 16 and
48 requests, c from a 512-token ride); inputs and outputs uniform as the bench's. A step beside requests
takes the bench's mean beside step and is gated, as the engine gates it, on an estimate (the longest of
recent steps): the larger of that mean and the estimate the bench recorded. The ride's cost is a proxy,
an inference prompt's chunk of C tokens at 16 decoding requests (coserving_cost.json): it has no adapter
terms, no loss and keeps no activations, so it is optimistic for co-serving by about 1-2 ms per 512
tokens. Left out: the host (async scheduling, the job's own turns), iteration-time noise, and the
deferrals of waiting requests (the bench's first ~0.46 s), so the calibration compares the share taken
beside running requests: at 4406aab, light rate 0.274 measured against the model's `beside` share.
Means over SEEDS runs of DURATION_S seconds; no jax.

The answer is in coserving_sim.json and benchmarks/results/h100/notes.md.

    python benchmarks/probes/coserving_sim.py   (coserving_sim.json, ~1 minute on a CPU)
"""
import dataclasses
import functools
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "results", "h100")
SEEDS, DURATION_S, HOLD_S = 4, 15.0, 0.06


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


cost = _load(os.path.join(HERE, "coserving_cost.json"))
bench = _load(os.path.join(RESULTS, "llama-8b_finetune.json"))
bench_256 = _load(os.path.join(RESULTS, "llama-8b_finetune_mb256.json"))
sizes = _load(os.path.join(HERE, "train_step_sizes.json"))["sizes"]
decode = cost["decode"]
PER_DECODE_S = (decode["48"]["alone_ms"] - decode["16"]["alone_ms"]) / 32 / 1e3  # b: per decoding request
BASE_S = decode["16"]["alone_ms"] / 1e3 - 16 * PER_DECODE_S  # a
PER_PREFILL_S = (decode["16"]["rides"]["512"]["ms"] - decode["16"]["alone_ms"]) / 512 / 1e3  # c
RIDE_S = {int(c): (r["ms"] - decode["16"]["alone_ms"]) / 1e3 for c, r in decode["16"]["rides"].items()}
FT = bench["finetune"]
SLO_S = FT["tpot_slo"]["1.2"]["tpot_slo_s"]  # the same SLO for every row (the 256-token bench had its own)
BACKWARD_S = sizes["512"]["backward_ms"] / 1e3
ARGS = bench["args"]
MAX_BATCHED = ARGS["max_num_batched_tokens"]


@dataclasses.dataclass(frozen=True)
class Job:
    """A job's micro step as the bench measured it: tokens, its mean time beside requests, the gate
    (what the engine's estimate asks of every request's slack), and the job's rate alone."""

    tokens: int
    step_s: float
    gate_s: float
    alone_tok_s: float

    @classmethod
    def measured(cls, finetune: dict, tokens: int) -> "Job":
        light = finetune["tpot_slo"]["1.2"]["runs"][0]
        step_s = light["fine_tuning_beside_s"] / light["fine_tuning_beside"]
        return cls(tokens, step_s, max(step_s, finetune["job_alone"]["iteration_s"]),
                   finetune["job_alone"]["tokens_per_s"])

    def faster_backward(self, backward_s: float) -> "Job":
        """The same job with its backward taking backward_s instead of today's (the alone rate with it)."""
        saved = BACKWARD_S - backward_s
        step_s = self.step_s - saved
        return Job(self.tokens, step_s, self.gate_s * step_s / self.step_s, self.alone_tok_s * self.step_s / step_s)


JOB = Job.measured(FT, 512)
JOB_256 = Job.measured(bench_256["finetune"], 256)


def iteration_s(decoding: int, prefilled: int) -> float:
    return BASE_S + PER_DECODE_S * decoding + PER_PREFILL_S * prefilled


def simulate(rate: float, seed: int, job: Job | None = JOB, policy: str = "time-shared", chunk: int = 0,
             backward_s: float = BACKWARD_S, ride_scale: float = 1.0) -> dict:
    """One run: p99 TPOT (s), p50 TTFT (s), and the job's tokens/s as a share of its alone rate, in all
    and beside running requests. policy: "time-shared" (today's rule), "hold" (admission held for the
    job's next step), "co-serving" (512-token micro-batches: the forward rides in `chunk`s at ride_scale
    times the measured ride, the backward a stall of backward_s). job None: inference alone."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * DURATION_S * 1.3) + 5))
    arrivals = arrivals[arrivals < DURATION_S]
    inputs = rng.integers(ARGS["uniform_input_range"][0], ARGS["uniform_input_range"][1] + 1, len(arrivals))
    outputs = rng.integers(ARGS["uniform_output_range"][0], ARGS["uniform_output_range"][1] + 1, len(arrivals))
    now, nxt, waiting, running, done = 0.0, 0, [], [], []
    trained = beside = ridden = pending = 0  # tokens; of them beside requests; forward tokens ridden; backwards owed
    coserving = policy == "co-serving"
    ride_s = RIDE_S.get(chunk, 0.0) * ride_scale
    stall_s = backward_s if coserving else (job.step_s if job else 0.0)
    gate_s = stall_s * job.gate_s / job.step_s if job else 0.0
    just_stepped = False
    while True:
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            waiting.append({"arrival": arrivals[nxt], "input": inputs[nxt], "output": outputs[nxt], "prefilled": 0,
                            "tokens": 0, "first": None, "last": None})
            nxt += 1
        training = job is not None and now < DURATION_S
        if not running and not waiting:
            if nxt >= len(arrivals):
                break
            if training:  # idle: Deferred Continuous Batching runs the job (an owed backward first)
                now += backward_s if pending else job.step_s
                pending, trained = max(pending - 1, 0), trained + job.tokens
            else:
                now = arrivals[nxt]
            continue
        decoding = [r for r in running if r["first"] is not None]
        slack = min((SLO_S * (r["tokens"] - 1) - (now - r["first"]) for r in decoding), default=None)
        if training and slack is not None and (pending or not coserving) and slack >= gate_s:
            now, just_stepped = now + stall_s, True
            trained, beside, pending = trained + job.tokens, beside + job.tokens, max(pending - 1, 0)
            continue
        hold = (policy == "hold" and training and decoding and waiting and not just_stepped
                and (job.gate_s - slack) / (SLO_S - iteration_s(len(decoding), 0)) * iteration_s(len(decoding), 0)
                <= HOLD_S
                and now - min(w["arrival"] for w in waiting) + HOLD_S + job.step_s
                <= FT["fine_tuning"]["deferral_bound_s"])
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
        if coserving and training and decoding and pending < 2:  # two micro-batches' activations at most
            if slack + SLO_S - (seconds + ride_s) >= 0:  # every request stays within its SLO
                seconds += ride_s
                ridden += chunk
                pending, ridden = pending + ridden // job.tokens, ridden % job.tokens
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
    alone = job.alone_tok_s * DURATION_S if job else 1.0
    return {"tpot_p99_s": float(np.percentile(tpot, 99)), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "job_kept": trained / alone, "job_kept_beside": beside / alone}


@functools.lru_cache(maxsize=None)
def inference_alone(rate: float, seed: int) -> dict:
    return simulate(rate, seed, job=None)


def mean_over_seeds(fraction: float, **kwargs) -> dict:
    rate = fraction * FT["capacity_rps"]
    runs = [(simulate(rate, seed, **kwargs), inference_alone(rate, seed)) for seed in range(SEEDS)]
    row = {key: float(np.mean([r[key] for r, _ in runs])) for key in ("job_kept", "job_kept_beside", "ttft_p50_s")}
    row["tpot_p99_ratio"] = float(np.mean([r["tpot_p99_s"] / alone["tpot_p99_s"] for r, alone in runs]))
    return row


if __name__ == "__main__":
    fractions = [float(f) for f in ARGS["rate_fractions"].split(",")]
    over = lambda **kwargs: {f: mean_over_seeds(f, **kwargs) for f in fractions}
    rows = {"time-shared": over(), "time-shared, 256-token micro steps": over(job=JOB_256), "hold": over(policy="hold")}
    for backward_ms in (round(BACKWARD_S * 1e3, 1), 22.0, 15.0, 10.0):
        backward_s = backward_ms / 1e3
        if backward_ms < round(BACKWARD_S * 1e3, 1):  # today's is the first row
            rows[f"time-shared, backward={backward_ms}ms"] = over(job=JOB.faster_backward(backward_s))
        for chunk in (64, 128, 256):
            rows[f"co-serving C={chunk}, backward={backward_ms}ms"] = over(
                job=JOB.faster_backward(backward_s), policy="co-serving", chunk=chunk, backward_s=backward_s)
        for ride_scale in (0.5, 0.25, 0.0):  # a ride nearer its GEMMs' share (coserving_shared_reads.json: ~0.4)
            rows[f"co-serving C=128, backward={backward_ms}ms, ride x{ride_scale}"] = over(
                job=JOB.faster_backward(backward_s), policy="co-serving", chunk=128, backward_s=backward_s,
                ride_scale=ride_scale)
    for name, row in rows.items():
        print(f"{name:38s}", "  ".join(f"{f}: kept {r['job_kept']:.3f} (beside {r['job_kept_beside']:.3f}) "
                                       f"tpot99 x{r['tpot_p99_ratio']:.2f} ttft50 {1e3 * r['ttft_p50_s']:.0f}ms"
                                       for f, r in row.items()))
    runs = FT["tpot_slo"]["1.2"]["runs"]
    measured = {f: {"kept": run["fine_tuning_tokens_per_s"] / JOB.alone_tok_s,
                    "kept_beside": run["fine_tuning_beside"] * JOB.tokens / run["seconds"] / JOB.alone_tok_s}
                for f, run in zip(fractions, runs)}
    print("measured time-shared (bench finetune):", measured)
    result = {"what": __doc__.split("\n\n")[0], "constants": {
        "decode_base_ms": BASE_S * 1e3, "per_decode_ms": PER_DECODE_S * 1e3, "per_prefill_ms": PER_PREFILL_S * 1e3,
        "ride_ms": {c: s * 1e3 for c, s in RIDE_S.items()}, "tpot_slo_ms": SLO_S * 1e3,
        "job_512": dataclasses.asdict(JOB), "job_256": dataclasses.asdict(JOB_256),
        "backward_512_ms": BACKWARD_S * 1e3, "hold_s": HOLD_S, "seeds": SEEDS, "duration_s": DURATION_S},
        "rate_fractions": fractions, "measured_time_shared": measured, "simulated": rows}
    with open(os.path.join(os.environ.get("OUT", HERE), "coserving_sim.json"), "w") as f:
        json.dump(result, f, indent=1)
