"""Several controller processes (one per host, or one per GPU) running the same device programs.

With `jax.distributed`, every process must dispatch the same programs in the same order: a program
spanning devices of several processes meets itself in their collectives. Process 0 runs the
scheduler (and the HTTP server); its runner sends each call that dispatches device work (`execute`,
`precompile`, `stop`) to the others before making it, and they make the same call in a worker loop
(`run_worker`). Only control data crosses, on the host (ORCA's control plane): one TCP connection
from each worker to process 0 (multiprocessing.connection: HMAC-authenticated, bytes only, never
unpickled). A device collective as the channel (jax's broadcast_one_to_all) would queue behind the
step in flight on the GPUs, so no process could dispatch step k+1 before step k finished.

Processes fail together. Each worker holds a second connection to process 0 that nobody writes to
(its liveness line); a watchdog thread at both ends waits on those lines, and when one closes (its
process exited, crashed or was killed) it logs which process is gone and ends this one with status 1
within a second, without jax's shutdown barrier: a collective waiting for a dead peer would hang
forever, and the barrier would wait for it (ParallelConfig.shutdown_timeout_s, long: a finished
process on a busy host waits there for its slower peers, and exits 0 with them). jax's own heartbeat
(ParallelConfig.peer_timeout_s) backs this up for a host that freezes with its sockets open.

A message is a fixed-size int32 header (what, the payload's length, the batch's shape key and
counts) followed by the payload's int32s, so a receiver always knows the shape to expect.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import threading
import time
from multiprocessing import connection
from typing import Callable

import jax
import numpy as np

from orca_jax.config import ParallelConfig
from orca_jax.sample.inputs import SAMPLING_ARRAYS, SamplingInputs
from orca_jax.sample.mode import SampleMode
from orca_jax.worker.compilation import ProgramKey, key_from_json, key_to_json
from orca_jax.worker.input_batch import FORWARD_ARRAYS, BatchDims, RaggedBatch

log = logging.getLogger(__name__)

_HEADER_LEN = 15
_ARRAYS = FORWARD_ARRAYS + SAMPLING_ARRAYS  # a batch's arrays in the payload's order
_CONTROL, _LIVENESS = 0, 1  # the two connections a worker opens, in this order
CONTROL_KEY_ENV = "ORCA_JAX_CONTROL_KEY"
# How long the processes wait for each other's control connections. They reach this point after
# jax.distributed joined them, each after building its own runner: 120 s ran out while process 0 was
# still building on a loaded 2-core machine. A process that dies meanwhile is noticed by jax's
# heartbeat or its closed coordinator connection, so this only bounds a process that hangs.
CONNECT_TIMEOUT_S = 900.0


class _Kind(enum.IntEnum):
    EXECUTE = 1
    PRECOMPILE = 2
    STOP = 3


class PeerLost(RuntimeError):
    """Another controller process is gone (its connection closed)."""


def initialize(parallel: ParallelConfig) -> None:
    """Join the processes named by `parallel` (no-op for one process); call before any other jax use."""
    if parallel.num_processes == 1:
        return
    # Cross-process collectives on CPU (tests) need gloo; GPUs use NCCL.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Both by name: jax 0.10.2 to 0.12 take them (ints, seconds).
    jax.distributed.initialize(coordinator_address=parallel.coordinator_address,
                               num_processes=parallel.num_processes, process_id=parallel.process_id,
                               heartbeat_timeout_seconds=max(1, round(parallel.peer_timeout_s)),
                               shutdown_timeout_seconds=max(1, round(parallel.shutdown_timeout_s)))


def is_leader() -> bool:
    """Process 0 schedules and serves; the others run `run_worker`."""
    return jax.process_index() == 0


def control_address(parallel: ParallelConfig) -> tuple[str, int]:
    """Where process 0 listens for its workers: the coordinator's host, ParallelConfig.control_port
    (default: the coordinator's port + 1)."""
    host, port = parallel.coordinator_address.rsplit(":", 1)
    return host, parallel.control_port if parallel.control_port is not None else int(port) + 1


def control_key(parallel: ParallelConfig) -> bytes:
    """The channel's shared secret: $ORCA_JAX_CONTROL_KEY on every process, else one derived from
    the coordinator's address (enough to keep strays out, not attackers: set the variable on a
    network others can reach)."""
    secret = os.environ.get(CONTROL_KEY_ENV)
    return secret.encode() if secret else hashlib.sha256(f"orca_jax:{parallel.coordinator_address}".encode()).digest()


def encode_batch(batch: RaggedBatch) -> tuple[np.ndarray, np.ndarray]:
    """(header i32[_HEADER_LEN], payload i32[n]): every array present viewed as int32, concatenated
    in FORWARD_ARRAYS' then SAMPLING_ARRAYS' order; the header holds the sizes, the statics and which
    arrays are present."""
    arrays = [getattr(batch, name) for name, _, _ in FORWARD_ARRAYS] \
        + [getattr(batch.sampling, name) for name, _, _ in SAMPLING_ARRAYS]
    present = [array is not None for array in arrays]
    payload = np.concatenate([np.ascontiguousarray(array, dtype).ravel().view(np.int32)
                              for array, (_, _, dtype) in zip(arrays, _ARRAYS) if array is not None])
    bits = sum(1 << i for i, here in enumerate(present) if here)
    sampling = batch.sampling
    header = np.array([_Kind.EXECUTE, payload.size, *batch.dims, sampling.num_top_logprobs, sampling.sample_mode,
                       sampling.logits_processed, batch.num_real_tokens, batch.num_real_seqs, bits, 0], np.int32)
    return header, payload


def decode_batch(header: np.ndarray, payload: np.ndarray) -> RaggedBatch:
    """The inverse of encode_batch."""
    _, _, *sizes, top, mode, processed, real_tokens, real_seqs, bits, _ = (int(x) for x in header)
    dims = BatchDims(*sizes)
    arrays, offset = {}, 0
    for i, (name, shape_of, dtype) in enumerate(_ARRAYS):
        if bits >> i & 1:
            shape = shape_of(dims)
            size = int(np.prod(shape))
            arrays[name] = payload[offset:offset + size].view(dtype).reshape(shape).copy()
            offset += size
    forward = {name: arrays.pop(name) for name, _, _ in FORWARD_ARRAYS if name in arrays}
    sampling = SamplingInputs(**arrays, num_top_logprobs=top, sample_mode=SampleMode(mode),
                              logits_processed=bool(processed))
    return RaggedBatch(**forward, sampling=sampling, num_real_tokens=real_tokens, num_real_seqs=real_seqs)


def _message(header: np.ndarray, payload: np.ndarray | None) -> bytes:
    return header.astype(np.int32).tobytes() + (b"" if payload is None else payload.astype(np.int32).tobytes())


def _unpack(message: bytes) -> tuple[np.ndarray, np.ndarray]:
    words = np.frombuffer(message, np.int32)
    return words[:_HEADER_LEN], words[_HEADER_LEN:]


def _bytes_payload(data: bytes) -> np.ndarray:
    padded = data + b" " * (-len(data) % 4)
    return np.frombuffer(padded, np.int32)


def _end_process(message: str, on_lost: Callable[[str], None] | None) -> None:
    """Log why, let `on_lost` answer what it can (briefly), and exit 1 without jax's shutdown barrier."""
    log.error("%s: ending this process (%d)", message, jax.process_index())
    if on_lost is not None:
        done = threading.Thread(target=on_lost, args=(message,), daemon=True)
        done.start()
        done.join(timeout=2.0)
    logging.shutdown()
    os._exit(1)


class Mirror:
    """The control channel: process 0's side sends each runner call; the others receive them.

    Made by every process's runner at the same point of its start (after jax.distributed joined them).
    `on_lost(message)`, when set, runs (for up to 2 s) before a lost peer ends this process.
    """

    def __init__(self, parallel: ParallelConfig, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.is_leader = is_leader()
        self.on_lost: Callable[[str], None] | None = None
        self._stopping = False
        address, key = control_address(parallel), control_key(parallel)
        deadline = time.monotonic() + connect_timeout_s
        if self.is_leader:
            self._control, liveness = self._accept(address, key, jax.process_count() - 1, deadline)
        else:
            self._control = [self._connect(address, key, _CONTROL, deadline)]
            liveness = {self._connect(address, key, _LIVENESS, deadline): 0}
        threading.Thread(target=self._watch, args=(liveness,), name="orca-peer-watchdog", daemon=True).start()

    # ---- connecting ----

    @staticmethod
    def _accept(address: tuple[str, int], key: bytes, num_workers: int,
                deadline: float) -> tuple[list[connection.Connection], dict[connection.Connection, int]]:
        """Process 0: both connections of every worker, by process index."""
        control: dict[int, connection.Connection] = {}
        liveness: dict[connection.Connection, int] = {}
        timer = threading.Timer(max(deadline - time.monotonic(), 0.0), _end_process,
                                (f"the other processes did not connect to {address[0]}:{address[1]} in time", None))
        timer.daemon = True
        timer.start()
        with connection.Listener(address, authkey=key) as listener:
            while len(control) < num_workers or len(liveness) < num_workers:
                conn = listener.accept()
                process, kind = (int(x) for x in np.frombuffer(conn.recv_bytes(8), np.int32))
                if kind == _CONTROL:
                    control[process] = conn
                else:
                    liveness[conn] = process
        timer.cancel()
        return [control[p] for p in sorted(control)], liveness

    @staticmethod
    def _connect(address: tuple[str, int], key: bytes, kind: int, deadline: float) -> connection.Connection:
        """A worker: one connection to process 0, retried until it listens."""
        while True:
            try:
                conn = connection.Client(address, authkey=key)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() > deadline:
                    _end_process(f"process 0 did not listen on {address[0]}:{address[1]} in time", None)
                time.sleep(0.1)
        conn.send_bytes(np.array([jax.process_index(), kind], np.int32).tobytes())
        return conn

    def _watch(self, liveness: dict[connection.Connection, int]) -> None:
        """Until a liveness line closes (nobody writes on them: readable means closed)."""
        while liveness:
            for conn in connection.wait(list(liveness)):
                process = liveness.pop(conn)
                try:
                    conn.recv_bytes()
                except (EOFError, OSError):
                    pass
                if not self._stopping:
                    _end_process(f"controller process {process} is gone (its connection closed: it exited, "
                                 "crashed or was killed)", self.on_lost)

    # ---- process 0 sends ----

    def _send(self, header: np.ndarray, payload: np.ndarray | None = None) -> None:
        message = _message(header, payload)
        for process, conn in enumerate(self._control, start=1):
            try:
                conn.send_bytes(message)
            except OSError as error:
                raise PeerLost(f"controller process {process} is gone ({error})") from error

    def execute(self, batch: RaggedBatch) -> None:
        if self.is_leader:
            self._send(*encode_batch(batch))

    def precompile(self, keys: list[ProgramKey], warm: bool) -> None:
        if self.is_leader:
            payload = _bytes_payload(json.dumps([key_to_json(k) for k in keys]).encode())
            self._send(np.array([_Kind.PRECOMPILE, payload.size] + [0] * (_HEADER_LEN - 3) + [warm], np.int32), payload)

    def stop(self) -> None:
        """Process 0: end the workers' loops (they exit; their lines closing is then expected)."""
        if self.is_leader and not self._stopping:
            self._stopping = True
            self._send(np.array([_Kind.STOP] + [0] * (_HEADER_LEN - 1), np.int32))

    # ---- the others receive ----

    def receive(self) -> tuple[np.ndarray, np.ndarray]:
        try:
            message = self._control[0].recv_bytes()
        except (EOFError, OSError):
            _end_process("controller process 0 is gone (its connection closed: it exited, crashed or was killed)",
                         self.on_lost)
        header, payload = _unpack(message)
        if int(header[0]) == _Kind.STOP:
            self._stopping = True
        return header, payload


def run_worker(runner) -> int:
    """On a process other than 0: make process 0's runner calls here too, until it stops; returns the
    number of iterations run. `runner` is a ModelRunner built from the same config as process 0's."""
    mirror = runner.mirror
    if mirror is None or mirror.is_leader:
        raise RuntimeError("process 0 schedules; run_worker is for the other processes")
    iterations = 0
    while True:
        header, payload = mirror.receive()
        kind = _Kind(int(header[0]))
        if kind is _Kind.STOP:
            return iterations
        if kind is _Kind.PRECOMPILE:
            keys = [key_from_json(k) for k in json.loads(payload.tobytes().decode())]
            runner.precompile(keys, warm=bool(header[-1]))
        else:
            # Nothing here reads the tokens: the result is dropped once dispatched (it still runs).
            runner.execute(decode_batch(header, payload))
            iterations += 1
