"""The KV pool lends its top pages to a fine-tuning job, and takes them back when inference needs them.

FineTuningConfig.memory_policy LEND (the default): the pool is sized as if no job ever ran, and its top
memory_gib of pages are lendable. A job that starts borrows them: the host allocator withdraws them
(KVCacheManager.lend: only while none is held and every reservation fits below, which the allocator makes
likely by handing them out last, so no running request is ever preempted for a job), then every
layer's K/V arrays are cut to the smaller pool, which frees that memory on the device for the job's
state and activations. Inference then runs the forwards compiled for the smaller pool
(ForwardKey.lent). When a request the smaller pool cannot admit has waited half the deferral bound,
the job parks (its state copied to the host, its device arrays freed: finetune/tuner.py) and the
pages come back; the job borrows them again once they are free. With RESERVE the pool is sized
memory_gib smaller from the start and nothing moves.

Why arrays are resized rather than pages marked: XLA gives a freed buffer's memory to the next
allocation, but a page range inside a live array is not freed. The cost is a second set of forward
programs, compiled on a thread when the first job starts (and cached on disk like the rest), and one
copy of the pool's kept pages per loan or reclaim.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

from orca_jax.config import FineTuningConfig, FineTuningMemory
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.worker.compilation import usable_cores


def pool_arguments(config: FineTuningConfig | None) -> dict:
    """The runner's pool arguments for a fine-tuning job's memory: lendable, or held back from the start."""
    if config is None:
        return {}
    memory = int(config.memory_gib * 2**30)
    if config.memory_policy is FineTuningMemory.LEND:
        return {"lendable_bytes": memory}
    return {"reserve_bytes": memory}


@dataclasses.dataclass(slots=True)
class LoanStats:
    """Counters since start (the metrics' KV-loan series)."""

    loans: int = 0  # times the pages went to a job
    reclaims: int = 0  # times they came back
    seconds: float = 0.0  # spent resizing the pool (both ways), the engine thread waiting


class KVLoan:
    """The lendable pages of one engine's pool: prepared once, lent and reclaimed on the engine thread."""

    def __init__(self, kv: KVCacheManager, runner):
        """`runner`: the ModelRunner whose pool kv describes (lendable_pages of it)."""
        if kv.num_pages - kv.loan_start != runner.lendable_pages:
            raise ValueError(f"the allocator lends {kv.num_pages - kv.loan_start} pages, the runner "
                             f"{runner.lendable_pages}")
        self._kv, self._runner = kv, runner
        self._prepared: concurrent.futures.Future | None = None
        self.stats = LoanStats()

    @property
    def num_pages(self) -> int:
        """Pages lent while lent."""
        return self._kv.num_pages - self._kv.loan_start

    @property
    def lent(self) -> bool:
        return self._kv.lent

    def prepare(self) -> concurrent.futures.Future:
        """Compile the smaller pool's programs on a thread of their own (once; serving goes on)."""
        if self._prepared is None:
            pool = concurrent.futures.ThreadPoolExecutor(1, "orca-kv-loan-compile")
            # Half the cores: the engine thread goes on serving meanwhile.
            self._prepared = pool.submit(self._runner.prepare_lending, max(1, usable_cores() // 2))
            pool.shutdown(wait=False)
        return self._prepared

    @property
    def ready(self) -> bool:
        """Whether prepare's programs are compiled (raises what compiling them raised)."""
        if self._prepared is None or not self._prepared.done():
            return False
        self._prepared.result()
        return True

    def lend(self) -> bool:
        """Lend the pages now if the allocator can spare them; True once lent (already or now)."""
        if self.lent:
            return True
        if not self.ready or not self._kv.lend():
            return False
        start = time.perf_counter()
        self._runner.resize_pool(lent=True)
        self.stats.loans += 1
        self.stats.seconds += time.perf_counter() - start
        return True

    def reclaim(self) -> None:
        """Take the pages back (the borrower has freed its device memory first)."""
        if not self.lent:
            return
        start = time.perf_counter()
        self._runner.resize_pool(lent=False)
        self._kv.reclaim()
        self.stats.reclaims += 1
        self.stats.seconds += time.perf_counter() - start
