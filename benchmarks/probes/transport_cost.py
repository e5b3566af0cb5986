"""One engine iteration's message from a core to a front end: the pipe and pickle we use against pyzmq and
msgspec (vLLM's choice), each end's CPU per message.

The message is what a core sends after a decode step of `--rows` requests (engine/output_wire.py's rows:
one new token and its character each, plus the engine's stats). A sender process sends `--messages` of
them as fast as the receiver (this process) takes them; each side reports its own CPU time per message.
Transports: a multiprocessing Pipe with pickle (what engine/core_process.py does), and a zmq PUSH/PULL
pair over ipc with msgspec's msgpack (rows as arrays; the stats as a plain array too), and with pickle.

    PYTHONPATH=.:SITE python benchmarks/probes/transport_cost.py --json OUT.json   (SITE: pyzmq, msgspec)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import pickle
import statistics
import tempfile
import time

from orca_jax.engine import EngineStats
from orca_jax.engine.output_wire import OutputEncoder
from orca_jax.outputs import RequestOutput


def message(rows: int, step: int):
    """A CoreIteration's fields for step `step` of `rows` decoding requests: one token each."""
    encoder = OutputEncoder()

    def outputs(length: int) -> list[RequestOutput]:
        ids = [97 + i % 26 for i in range(length)]
        return [RequestOutput(f"cmpl-{r:032x}", ids[-1:], chr(ids[-1]), list(ids), "".join(map(chr, ids)), 64)
                for r in range(rows)]

    encoder.encode_all(outputs(step))  # what the front end has by now
    return ([], encoder.encode_all(outputs(step + 1)), EngineStats(iterations=step), True, [], None)


def _send_pipe(conn, rows: int, count: int, result) -> None:
    fields = message(rows, 64)
    cpu = time.process_time()
    for _ in range(count):
        conn.send_bytes(pickle.dumps(fields, pickle.HIGHEST_PROTOCOL))
    result.put(time.process_time() - cpu)


def _send_zmq(path: str, rows: int, count: int, codec: str, result) -> None:
    import msgspec
    import zmq

    socket = zmq.Context().socket(zmq.PUSH)
    socket.connect(path)
    accepted, rows_, stats, ran, calls, loras = message(rows, 64)
    encode = msgspec.msgpack.Encoder().encode
    fields = [f.name for f in dataclasses.fields(EngineStats)]
    cpu = time.process_time()
    for _ in range(count):
        if codec == "msgspec":
            data = encode((accepted, rows_, [getattr(stats, name) for name in fields], ran, calls, loras))
        else:
            data = pickle.dumps((accepted, rows_, stats, ran, calls, loras), pickle.HIGHEST_PROTOCOL)
        socket.send(data, copy=False)
    result.put(time.process_time() - cpu)
    socket.close(linger=-1)


def measure(transport: str, rows: int, count: int) -> dict:
    context = multiprocessing.get_context("spawn")
    result = context.SimpleQueue()
    if transport == "pipe+pickle":
        receiver, sender_end = context.Pipe(duplex=False)
        sender = context.Process(target=_send_pipe, args=(sender_end, rows, count, result))
        sender.start()
        sender_end.close()
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(count):
            pickle.loads(receiver.recv_bytes())
    else:
        import msgspec
        import zmq

        codec = transport.split("+")[1]
        path = f"ipc://{tempfile.mkdtemp()}/core"
        socket = zmq.Context().socket(zmq.PULL)
        socket.bind(path)
        sender = context.Process(target=_send_zmq, args=(path, rows, count, codec, result))
        sender.start()
        decode = msgspec.msgpack.Decoder().decode
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(count):
            data = socket.recv(copy=False)
            if codec == "msgspec":
                accepted, rows_, stats, *rest = decode(data.buffer)
                EngineStats(*stats)
            else:
                pickle.loads(data.buffer)
    receiver_cpu, wall = time.process_time() - cpu, time.perf_counter() - start
    sender_cpu = result.get()
    sender.join()
    return {"transport": transport, "rows": rows, "messages": count,
            "sender_us_per_message": 1e6 * sender_cpu / count, "receiver_us_per_message": 1e6 * receiver_cpu / count,
            "wall_us_per_message": 1e6 * wall / count,
            "bytes": len(pickle.dumps(message(rows, 64), pickle.HIGHEST_PROTOCOL))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = []
    for rows in args.rows:
        for _ in range(args.rounds):
            for transport in ("pipe+pickle", "zmq+msgspec", "zmq+pickle"):
                runs.append(measure(transport, rows, args.messages))
                print(json.dumps(runs[-1]), flush=True)
    summary = {f"{t} {rows} rows": {side: statistics.median(r[f"{side}_us_per_message"] for r in runs
                                                           if r["transport"] == t and r["rows"] == rows)
                                   for side in ("sender", "receiver", "wall")}
               for rows in args.rows for t in ("pipe+pickle", "zmq+msgspec", "zmq+pickle")}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "runs": runs, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
