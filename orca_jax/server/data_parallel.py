"""Data-parallel replicas behind one front end (`--data-parallel-size N`): an EngineClient over N engine
cores, each a ProcessEngine on its own devices (engine/replicas.py: replica_devices).

A request goes to the replica the router picks (engine/router.py: the replica holding the longest
prefix of its prompt, unless it is busier than the least loaded by more than the router's imbalance;
else the least loaded). What the server reads of one engine it reads of all: readiness is every
replica's, the stats are summed (the last iteration's time and the peak in flight are the largest), a
replica that fails fails the server, and a prefix-cache reset or an adapter load goes to every one
(an adapter some replica refuses is unloaded from those that took it, so all serve the same ones).

Behind several API server processes (`serve --api-server-count N`) each has one of these over the
same cores; they route as one router would: the prefix map is shared (`owners`) and the loads are
every API server's requests in flight (`loads`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence

from orca_jax.engine import EngineStats
from orca_jax.engine.router import PrefixOwners, ReplicaRouter, adapter_salt
from orca_jax.lora.request import LoRARequest
from orca_jax.server.async_engine import Readiness
from orca_jax.server.process_engine import ProcessEngine


def start_replicas(builders: Sequence[Callable[[], ProcessEngine]]) -> list[ProcessEngine]:
    """Build every replica at once (each waits on its own core's start); a failure stops the rest."""
    with concurrent.futures.ThreadPoolExecutor(len(builders)) as pool:
        futures = [pool.submit(build) for build in builders]
        concurrent.futures.wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for replica in started:
            replica.shutdown(timeout=5)
        raise failed[0]
    return started


class DataParallelEngine:
    """N engine cores behind one EngineClient (server/engine_client.py). `owners`: the router's prefix
    map (its own when None); `loads`: each replica's requests in flight (this front end's when None);
    `first_replica`: where the router's ties start."""

    def __init__(self, replicas: Sequence[ProcessEngine], *, imbalance: int = 8,
                 on_ready: Callable[[], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 owners: PrefixOwners | None = None, loads: Callable[[], Sequence[int]] | None = None,
                 first_replica: int = 0):
        self.replicas = list(replicas)
        self.engine = self.replicas[0].engine  # the same model, config and tokenizer in each
        self.router = ReplicaRouter(len(self.replicas), self.engine.config.cache.page_size, imbalance,
                                    owners=owners, first=first_replica)
        self._loads = loads or (lambda: [r.num_in_flight for r in self.replicas])
        self.max_in_flight = sum(r.max_in_flight for r in self.replicas)
        self._on_ready, self._on_failure = on_ready, on_failure
        self._lock = threading.Lock()
        self._ready_count = 0
        self._failed = False
        for replica in self.replicas:  # their callbacks run on each replica's reader thread
            replica.on_ready = self._replica_ready
            replica.on_failure = self._replica_failed

    def _replica_ready(self) -> None:
        with self._lock:
            self._ready_count += 1
            all_ready = self._ready_count == len(self.replicas)
        if all_ready and self._on_ready is not None:
            self._on_ready()

    def _replica_failed(self, error: BaseException) -> None:
        with self._lock:
            first, self._failed = not self._failed, True
        if first and self._on_failure is not None:  # one replica down fails the server, as one engine does
            self._on_failure(error)

    # ---- what the server reads ------------------------------------------------------------------

    @property
    def readiness(self) -> Readiness:
        each = [r.readiness for r in self.replicas]
        return Readiness(ready=all(r.ready for r in each), compiled=sum(r.compiled for r in each),
                         total=sum(r.total for r in each) if all(r.total for r in each) else 0,
                         doing="; ".join(f"replica {i}: {r.describe()}" for i, r in enumerate(each)))

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def latest_stats(self) -> EngineStats:
        return EngineStats.summed(self.replica_stats)

    @property
    def replica_stats(self) -> list[EngineStats]:
        """Each replica's latest stats, in replica order."""
        return [r.latest_stats for r in self.replicas]

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def is_healthy(self) -> bool:
        return all(r.is_healthy for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def begin_shutdown(self) -> None:
        for replica in self.replicas:
            replica.begin_shutdown()

    def shutdown(self, timeout: float | None = None) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    def add_iteration_listener(self, listener: Callable[[EngineStats], None]) -> None:
        for replica in self.replicas:
            replica.add_iteration_listener(listener)

    def add_lora_listener(self, listener: Callable[[list[LoRARequest]], None]) -> None:
        self.replicas[0].add_lora_listener(listener)  # every replica registers the same adapters

    # ---- requests -------------------------------------------------------------------------------

    def route(self, prompt_token_ids: Sequence[int], lora_request=None) -> int:
        """The replica a request with this prompt goes to now (its adapter salts the prefix)."""
        return self.router.route(prompt_token_ids, self._loads(), adapter_salt(lora_request))

    async def submit(self, prompt_token_ids, sampling, *, request_id, priority=0, deadline=None,
                     lora_request=None, grammar=None):
        replica = self.replicas[self.route(prompt_token_ids, lora_request)]
        return await replica.submit(prompt_token_ids, sampling, request_id=request_id, priority=priority,
                                    deadline=deadline, lora_request=lora_request, grammar=grammar)

    async def reset_prefix_cache(self) -> int:
        return sum(await asyncio.gather(*(r.reset_prefix_cache() for r in self.replicas)))

    async def add_lora(self, lora_request, adapter) -> None:
        results = await asyncio.gather(*(r.add_lora(lora_request, adapter) for r in self.replicas),
                                       return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:  # all or none: the replicas that took it let it go again
            await asyncio.gather(*(r.remove_lora(lora_request.lora_int_id)
                                   for r, result in zip(self.replicas, results) if not isinstance(result, BaseException)),
                                 return_exceptions=True)
            raise errors[0]

    async def remove_lora(self, lora_int_id: int) -> bool:
        return all(await asyncio.gather(*(r.remove_lora(lora_int_id) for r in self.replicas)))
