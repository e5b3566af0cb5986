"""A digest of everything the host path decides over a run with no device: every plan row, the packed
forward inputs, the sampling inputs, the requests each update finishes, every RequestOutput (ids, text
deltas, stop reasons). 300 requests (prompts 8-500 tokens, half sharing a prefix; outputs 1-100; a
third with stop strings; greedy and sampled, min_tokens), tokens drawn so that EOS, stop strings and
split UTF-8 characters occur; a 400-page pool, so ON_DEMAND preempts; prefix caching off/on x
RESERVE/ON_DEMAND x async scheduling off/on.

A change meant to make the host faster without changing behaviour prints the same digests before and
after (issue 45: run it on both commits and diff):

    PYTHONPATH=. python benchmarks/probes/host_digest.py
"""
import hashlib
import random

from orca_jax.config import SchedulerConfig, KVAllocation
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.core.request import Request
from orca_jax.core.sched.scheduler import Scheduler
from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.engine.output_processor import request_output
from orca_jax.sampling_params import SamplingParams
from orca_jax.sample.batcher import SamplingBatcher
from orca_jax.worker.input_batch import BucketPolicy, build_batch, pack_forward_inputs
from orca_jax.tokenizer import ByteTokenizer

def run(caching, alloc, async_sched, seed=0, n=300):
    h = hashlib.sha256()
    rng = random.Random(seed)
    tok = ByteTokenizer(eos_token_ids=(2,), bos_token_id=1)
    kv = KVCacheManager(1 + 400, 16, enable_prefix_caching=caching)  # small: ON_DEMAND preempts
    buckets = BucketPolicy(max_num_batched_tokens=2048, max_num_seqs=128, max_pages=64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048, async_scheduling=async_sched,
                                      kv_allocation=alloc), kv, 1024, 2 if async_sched else 1,
                      token_target=buckets.token_target)
    sb = SamplingBatcher(0, 256, 8)
    shared = [rng.randrange(3, 256) for _ in range(200)]
    for i in range(n):
        p = rng.randint(8, 300); o = rng.randint(1, 100)
        prompt = (shared[:rng.randint(0, 200)] if rng.random() < 0.5 else []) + [rng.randrange(3, 256) for _ in range(p)]
        stop = ("ab", "\ufffdx") if i % 3 == 0 else ()
        sp = SamplingParams(max_tokens=o, ignore_eos=i % 2 == 0, temperature=0.0 if i % 4 else 0.7, stop=stop, seed=i,
                            min_tokens=i % 5)
        sched.add_request(Request(str(i), prompt, sp, eos_token_ids=(2,), detokenizer=IncrementalDetokenizer(tok, stop), seed=i))
    pending = []
    while sched.has_unfinished() or pending:
        while sched.can_schedule and sched.has_unfinished():
            out = sched.schedule()
            if not out.scheduled:
                break
            b = build_batch(out, buckets, sb)
            h.update(pack_forward_inputs(b).tobytes())
            h.update(repr([(s.request.request_id, s.start, s.token_ids, s.page_ids, s.step, s.token_source) for s in out.scheduled]).encode())
            h.update(repr((b.sampling.temperature.tolist(), b.sampling.seed.tolist(), b.sampling.step.tolist(), b.sampling.sample_mode)).encode())
            pending.append(out)
        if not pending:
            break
        out = pending.pop(0)
        toks = [rng.choice([2, 97, 98, 120, 200, 65, 66, 0xe2, 0x82, 0xac, 33]) for _ in out.scheduled]
        fin = sched.update(out, toks)
        h.update(repr([r.request_id for r in fin]).encode())
        for s in out.scheduled:
            r = s.request
            num_new = len(r.output_token_ids) - s.step
            if r.status.finished or num_new > 0:
                o = request_output(r, max(num_new, 0))
                h.update(repr((o.request_id, o.new_token_ids, o.new_text, o.output_token_ids, o.text, o.finished,
                               o.finish_reason, o.stop_reason, o.num_cached_tokens)).encode())
    return f"{h.hexdigest()[:16]} ({sched.num_preemptions} preemptions)"

for caching in (False, True):
    for alloc in (KVAllocation.RESERVE, KVAllocation.ON_DEMAND):
        for async_sched in (False, True):
            print(caching, alloc.name, async_sched, run(caching, alloc, async_sched))
