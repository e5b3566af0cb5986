"""A helper process's pipes: length-prefixed frames both ways, and the worker's side of its stdio.

The grammar workers (structured/sandbox.py) and the tokenizer worker (server/tokenizer_process.py) are
child processes that read requests from stdin and answer on stdout. Frames are read with os.read on
the descriptor (never through a buffered file's read), so a reader can wait with a deadline.
Standard library only: a worker imports this before anything heavy.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import sys
import time
from typing import BinaryIO

HEADER = struct.Struct("<Q")  # a frame: its payload's length, then the payload
WORKER_NICENESS = 10  # below the server's threads: its event loop and engine win the cores


def write_frame(pipe: BinaryIO, payload: bytes) -> None:
    pipe.write(HEADER.pack(len(payload)) + payload)
    pipe.flush()


def read_frame(pipe: BinaryIO, deadline: float | None = None, max_bytes: int | None = None) -> bytes:
    """The next frame's payload; EOFError when the other end closed (or sent more than max_bytes),
    TimeoutError past `deadline` (time.monotonic()), None: wait as long as it takes."""
    (size,) = HEADER.unpack(_read_exactly(pipe, HEADER.size, deadline))
    if max_bytes is not None and size > max_bytes:
        raise EOFError(f"a frame of {size} bytes, more than the {max_bytes} expected")
    return _read_exactly(pipe, size, deadline)


def _read_exactly(pipe: BinaryIO, size: int, deadline: float | None) -> bytes:
    fd = pipe.fileno()
    chunks, remaining = [], size
    while remaining:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def worker_stdio() -> tuple[BinaryIO, BinaryIO]:
    """In the worker, first: (frames in, frames out). It runs below the server's priority, stray prints
    go to stderr (they must not break the frames), and Ctrl-C, which reaches the whole process group,
    is left to the server, which stops its workers."""
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    frames_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return sys.stdin.buffer, frames_out
