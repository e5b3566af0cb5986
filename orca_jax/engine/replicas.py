"""Data-parallel replicas driven by a blocking caller: N engine cores, each in its own process on its own
devices, seen as one Engine by LLM(data_parallel_size=N).

EngineReplicas has the Engine methods LLM uses (add_request, step, abort, has_unfinished, stats,
tokenizer), so generate, chat and stream run unchanged over it. A request goes where the server's
DataParallelEngine would send it (engine/router.py: its prefix's replica, else the least loaded);
request ids are numbered as one engine numbers them ("req-0", "req-1", ...), so a request's seed,
and with it a sampled output, is the one a single engine would give it. step() waits until some core
reports and returns what it reported. A refusal (a ValueError the engine raised in its core, or a
full pool) comes back from the step() that reads it, not from add_request; LLM's callers abort the
rest and raise it either way. A core that dies raises EngineDeadError from step() and every call after.

One reader thread drains every core's pipe into a queue, as ProcessEngine's does: a caller busy
sending a long list of prompts never leaves a core blocked on a full pipe (which, with the caller
then blocked on the core's, would hang both).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from orca_jax.engine.core_client import CoreProcess
from orca_jax.engine.core_process import AbortRequest, AddRequest, CoreFailed, CoreIteration, Shutdown
from orca_jax.engine.output_wire import Received, request_id_of
from orca_jax.engine.router import ReplicaRouter, adapter_salt
from orca_jax.engine.stats import EngineStats

if TYPE_CHECKING:
    from orca_jax.config import EngineConfig, ParallelConfig
    from orca_jax.engine import Engine
    from orca_jax.lora.request import LoRARequest
    from orca_jax.outputs import RequestOutput
    from orca_jax.sampling_params import SamplingParams

STOP_SECONDS = 10.0  # for a core to answer Shutdown before it is killed


class EngineDeadError(RuntimeError):
    """A replica's engine core failed or its process died; the replicas cannot go on."""


def replica_devices(visible: str | None, replica: int, devices_per_replica: int) -> str:
    """CUDA_VISIBLE_DEVICES for one replica: its contiguous slice of the devices this process sees
    (`visible`: this process's CUDA_VISIBLE_DEVICES, or None for every GPU by index)."""
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    start = replica * devices_per_replica
    if ids is None:
        return ",".join(str(i) for i in range(start, start + devices_per_replica))
    if start + devices_per_replica > len(ids):
        raise ValueError(f"replica {replica} needs devices {start}..{start + devices_per_replica - 1} of "
                         f"CUDA_VISIBLE_DEVICES={visible}: too few for the replicas' devices")
    return ",".join(ids[start:start + devices_per_replica])


@dataclasses.dataclass(frozen=True, slots=True)
class EngineBuild:
    """Picklable: a core process calls it to build its Engine from `config` on `visible_devices`
    (CUDA_VISIBLE_DEVICES, set before jax starts its backend; None: this process's)."""

    config: EngineConfig
    visible_devices: str | None = None

    def __call__(self) -> Engine:
        if self.visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.visible_devices
        from orca_jax.engine import Engine

        return Engine(self.config)


def replica_builds(config: EngineConfig, data_parallel_size: int) -> list[EngineBuild]:
    """Each replica's engine: `config` on its slice of this process's GPUs; ValueError for what cannot
    run across the process boundary."""
    if config.fine_tuning is not None:
        raise ValueError(f"fine-tuning (enable_fine_tuning) trains in the engine's own process: not with "
                         f"data_parallel_size={data_parallel_size}")
    if config.parallel.num_processes != 1:
        raise ValueError(f"an engine over several controller processes (ParallelConfig.num_processes) cannot be "
                         f"a replica: not with data_parallel_size={data_parallel_size}")
    return [EngineBuild(config, devices) for devices in replica_device_slices(config.parallel, data_parallel_size)]


def replica_device_slices(parallel: ParallelConfig, data_parallel_size: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each replica of this layout: contiguous slices of this process's GPUs."""
    per_replica = parallel.tensor_parallel * parallel.num_stages
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [replica_devices(visible, r, per_replica) for r in range(data_parallel_size)]


class EngineReplicas:
    """One engine core per EngineBuild (built at once, each in its own process), driven as one Engine."""

    def __init__(self, builds: Sequence[EngineBuild], *, imbalance: int = 8, log_level: str = "warning"):
        self.cores = [CoreProcess(build, log_level=log_level) for build in builds]
        try:
            infos = [core.wait_built() for core in self.cores]  # they load and compile side by side
        except BaseException:  # one failed to start: the others are stopped where they are
            for core in self.cores:
                core.close(0.0)
            raise
        self.config, self.model_config = infos[0].config, infos[0].model_config
        self.max_model_len, self.tokenizer = infos[0].max_model_len, infos[0].tokenizer
        self.router = ReplicaRouter(len(self.cores), self.config.cache.page_size, imbalance)
        self._latest = [info.stats for info in infos]  # each core's stats as of its last message
        self._where: dict[str, int] = {}  # unfinished request id -> its replica
        self._received: dict[str, Received] = {}  # unfinished request id -> its outputs' totals so far
        self._loads = [0] * len(self.cores)  # unfinished requests per replica (the router's load)
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None  # set once a core failed: nothing can run after it
        self._messages: queue.SimpleQueue = queue.SimpleQueue()  # (replica, message; None: its pipe ended)
        self._reader = threading.Thread(target=self._read, name="orca-replicas-reader", daemon=True)
        self._reader.start()

    def add_request(self, prompt: str | list[int], sampling: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0, deadline: float | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Engine.add_request's contract, except that a refusal is raised by a later step()."""
        if self._dead is not None:
            raise self._dead
        token_ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        replica = self.router.route(token_ids, self._loads, adapter_salt(lora_request))
        self.cores[replica].send(AddRequest(request_id, token_ids, sampling, priority, deadline, lora_request))
        self._where[request_id] = replica
        self._received[request_id] = Received()
        self._loads[replica] += 1
        return request_id

    def abort(self, request_id: str) -> bool:
        replica = self._forget(request_id)
        if replica is not None:
            self.cores[replica].send(AbortRequest(request_id))
        return replica is not None

    def has_unfinished(self) -> bool:
        return bool(self._where)

    def stats(self) -> EngineStats:
        """All replicas as one (EngineStats.summed), as of each one's latest report."""
        return EngineStats.summed(self._latest)

    @property
    def replica_stats(self) -> list[EngineStats]:
        """Each replica's stats as of its latest report, in replica order."""
        return list(self._latest)

    def step(self) -> list[RequestOutput]:
        """The outputs the cores reported since the last call, waiting for a report while requests are
        unfinished; raises the first refusal reported, or EngineDeadError."""
        if self._dead is not None:
            raise self._dead
        if not self._where:
            return []
        batch = [self._messages.get()]
        while not self._messages.empty():
            batch.append(self._messages.get())
        outputs: list[RequestOutput] = []
        refusals: list[BaseException] = []
        for replica, message in batch:
            if message is None or isinstance(message, CoreFailed):
                self._dead = EngineDeadError(self._death(replica, message))
                raise self._dead
            if isinstance(message, CoreIteration):
                self._latest[replica] = message.stats
                for request_id, error in message.accepted:
                    if error is not None and self._forget(request_id) is not None:
                        refusals.append(error)
                for row in message.outputs:
                    received = self._received.get(request_id_of(row))
                    if received is None:  # aborted here; its core may still report it once
                        continue
                    output = received.decode(row)
                    if output.finished:
                        self._forget(output.request_id)
                    outputs.append(output)
        if refusals:
            raise refusals[0]
        return outputs

    def shutdown(self) -> None:
        """Stop every core (requests still running end unanswered) and wait for its process to exit."""
        for core in self.cores:
            core.send(Shutdown(0.0))
        self._reader.join(STOP_SECONDS)  # it ends once every core's pipe has
        for core in self.cores:
            core.close(0.1)  # killed if it has not exited by now
        self._reader.join(STOP_SECONDS)
        self._where.clear()
        self._received.clear()
        self._loads = [0] * len(self.cores)
        self._dead = self._dead or EngineDeadError("the data-parallel replicas were shut down")

    def _forget(self, request_id: str) -> int | None:
        """A request is over: off the books; its replica (None: it was not unfinished)."""
        replica = self._where.pop(request_id, None)
        self._received.pop(request_id, None)
        if replica is not None:
            self._loads[replica] -= 1
        return replica

    def _death(self, replica: int, message: CoreFailed | None) -> str:
        if message is not None:
            return f"data-parallel replica {replica}'s engine failed: {message.cause}\n{message.traceback}"
        process = self.cores[replica].process
        process.join(1.0)  # its pipe ended: its exit code is a moment away
        return f"data-parallel replica {replica}'s engine core process died (exit code {process.exitcode})"

    def _read(self) -> None:
        """The reader thread: each core's messages onto the queue as they come, then its pipe's end."""
        live = dict(enumerate(self.cores))
        while live:
            try:
                ready = set(wait([c.conn for c in live.values()] + [c.process.sentinel for c in live.values()]))
            except (OSError, ValueError):  # shutdown closed a pipe of a core that would not stop
                return
            for replica, core in list(live.items()):
                if core.conn not in ready and core.process.sentinel not in ready:
                    continue
                try:
                    while core.conn.poll(0):  # a dead core's pipe reads as ready, then as its end
                        self._messages.put((replica, core.conn.recv()))
                    if core.process.sentinel in ready:
                        raise EOFError
                except (EOFError, OSError, ValueError):
                    self._messages.put((replica, None))
                    del live[replica]
