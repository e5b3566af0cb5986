"""Several controller processes (one per host, or one per GPU) running the same device programs.

With `jax.distributed`, every process must dispatch the same programs in the same order, because a
program spanning devices of several processes meets itself in their collectives. Process 0 runs the
scheduler (and the HTTP server); the runner there sends each call that dispatches device work
(`execute`, `precompile`) to the other processes before making it, and they make the same call in a
worker loop (`run_worker`). Only control data crosses: the batch's numpy arrays and its bucket key.
Stages may sit on different processes: pipeline.Handoff moves activations and tokens between them.

The messages travel by `multihost_utils.broadcast_one_to_all` (a collective over all devices): a
fixed-size int32 header (what, the payload's length, the batch's shape key and counts), then the
payload as one int32 array, so a receiver always knows the shape to expect.
"""

from __future__ import annotations

import enum
import json

import jax
import numpy as np

from orca_jax.config import ParallelConfig
from orca_jax.sample.inputs import SAMPLING_ARRAYS, SamplingInputs
from orca_jax.sample.mode import SampleMode
from orca_jax.worker.compilation import ProgramKey, key_from_json, key_to_json
from orca_jax.worker.input_batch import FORWARD_ARRAYS, BatchDims, RaggedBatch

_HEADER_LEN = 15
_ARRAYS = FORWARD_ARRAYS + SAMPLING_ARRAYS  # a batch's arrays in the payload's order


class _Kind(enum.IntEnum):
    EXECUTE = 1
    PRECOMPILE = 2
    STOP = 3


def initialize(parallel: ParallelConfig) -> None:
    """Join the processes named by `parallel` (no-op for one process); call before any other jax use."""
    if parallel.num_processes == 1:
        return
    # Cross-process collectives on CPU (tests, and the broadcasts here) need gloo; GPUs use NCCL.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=parallel.coordinator_address,
                               num_processes=parallel.num_processes, process_id=parallel.process_id)


def is_leader() -> bool:
    """Process 0 schedules and serves; the others run `run_worker`."""
    return jax.process_index() == 0


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


def _bytes_payload(data: bytes) -> np.ndarray:
    padded = data + b" " * (-len(data) % 4)
    return np.frombuffer(padded, np.int32)


class Mirror:
    """Process 0's side sends; on the other processes every call here is a no-op."""

    def __init__(self):
        self.is_leader = is_leader()

    def execute(self, batch: RaggedBatch) -> None:
        if self.is_leader:
            _send(*encode_batch(batch))

    def precompile(self, keys: list[ProgramKey], warm: bool) -> None:
        if self.is_leader:
            payload = _bytes_payload(json.dumps([key_to_json(k) for k in keys]).encode())
            _send(np.array([_Kind.PRECOMPILE, payload.size] + [0] * (_HEADER_LEN - 3) + [warm], np.int32), payload)

    def stop(self) -> None:
        if self.is_leader:
            _send(np.array([_Kind.STOP] + [0] * (_HEADER_LEN - 1), np.int32), None)


def _send(header: np.ndarray, payload: np.ndarray | None) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.broadcast_one_to_all(header)
    if payload is not None and payload.size:
        multihost_utils.broadcast_one_to_all(payload)


def _receive() -> tuple[np.ndarray, np.ndarray]:
    from jax.experimental import multihost_utils

    header = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(_HEADER_LEN, np.int32)))
    size = int(header[1])
    payload = np.zeros(size, np.int32)
    if size:
        payload = np.asarray(multihost_utils.broadcast_one_to_all(payload))
    return header, payload


def run_worker(runner) -> int:
    """On a process other than 0: make process 0's runner calls here too, until it stops; returns the
    number of iterations run. `runner` is a ModelRunner built from the same config as process 0's."""
    if is_leader():
        raise RuntimeError("process 0 schedules; run_worker is for the other processes")
    iterations = 0
    while True:
        header, payload = _receive()
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
