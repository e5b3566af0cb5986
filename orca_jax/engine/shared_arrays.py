"""Named numpy arrays that several processes of one server map at once (`serve --api-server-count N`).

The API server processes share a little state: how many requests each has in flight on each replica
(the router's loads, /metrics' in-flight gauge), which replica holds which prompt prefix (the router's
affinity), and each one's token-gap histogram. One file holds every array, laid out by the specs
alone, so a process that knows the path and the specs maps the same bytes (np.memmap: the page cache
is the shared memory; the file lives in the server's run directory, removed with it). Each array is
written by one process per row where counts must add up (a row per API server, summed by readers),
and racily where a stale value only costs a routing hint.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ALIGN = 64  # bytes: each array starts on its own cache line


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySpec:
    name: str
    dtype: str  # numpy's name: "int64", "float64", ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return np.dtype(self.dtype).itemsize * math.prod(self.shape)


def _layout(specs: tuple[ArraySpec, ...]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for spec in specs:
        offsets.append(end)
        end += -(-spec.nbytes // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


class SharedArrays:
    """The arrays of `specs` in the file at `path`: create() makes it (zeros), attach() maps it."""

    def __init__(self, path: str, specs: tuple[ArraySpec, ...]):
        offsets, size = _layout(specs)
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        self._arrays = {spec.name: self._map[offset:offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)
                        for spec, offset in zip(specs, offsets)}

    @classmethod
    def create(cls, path: str, specs: tuple[ArraySpec, ...]) -> SharedArrays:
        with open(path, "wb") as f:
            f.truncate(_layout(specs)[1])  # zeros
        return cls(path, specs)

    @classmethod
    def attach(cls, path: str, specs: tuple[ArraySpec, ...]) -> SharedArrays:
        return cls(path, specs)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]
