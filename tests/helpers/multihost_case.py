"""One of several processes joined by jax.distributed on localhost (run by worker/test_pipeline.py):
`python tests/helpers/multihost_case.py PROCESS_ID NUM_PROCESSES PORT TP PP`. Process 0 schedules the
requests of pipeline_cases and prints their tokens as JSON; the others run the worker loop."""

from __future__ import annotations

import json
import sys

from orca_jax.config import ParallelConfig
from orca_jax.worker import multihost
from orca_jax.worker.compilation import key_to_json


def main() -> None:
    process_id, num_processes, port, tp, pp = (int(a) for a in sys.argv[1:6])
    processes = dict(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                     process_id=process_id)
    multihost.initialize(ParallelConfig(**processes))  # before anything else touches jax

    import jax
    from tests.helpers.pipeline_cases import engine_for, run

    engine = engine_for("llama", tp, pp, **processes)
    runner = engine.runner
    if not multihost.is_leader():
        iterations = multihost.run_worker(runner)
        print(json.dumps({"worker_iterations": iterations, "programs": sorted(map(key_to_json, runner.compilation.compiled_keys))}))
        return
    # Every batch of the run falls in this bucket (see pipeline_cases.engine_for): precompiled on every
    # process through the mirror, nothing compiles while running.
    runner.precompile(engine.program_keys())
    programs = sorted(map(key_to_json, runner.compilation.compiled_keys))
    result = run(engine)
    assert sorted(map(key_to_json, runner.compilation.compiled_keys)) == programs, "compiled while running"
    runner.stop_workers()
    devices = sorted({d.process_index for stage in runner.stages for d in stage.mesh.devices.flat})
    print(json.dumps(dict(result, processes=devices, num_devices=len(jax.devices()), programs=programs)))


if __name__ == "__main__":
    main()
