"""What a precompile reports while a user waits: each phase as it begins, every program compiled with an
estimate of the time left once one can be made, then the first runs; LLM(...) draws it as a bar."""

from __future__ import annotations

from orca_jax.worker.precompile_progress import (PhaseEstimate, PrecompilePhase, PrecompileProgress,
                                                 format_seconds)

from tests.helpers.engines import tiny_engine

SMALL = dict(max_num_seqs=2, max_num_batched_tokens=8, num_pages=16)  # one bucket: a dozen programs


def test_the_estimate_waits_for_a_full_program_then_goes_by_weight_and_threads():
    estimate = PhaseEstimate(total_weight=10.0, workers=2)
    estimate.step_done(0.05, 0.1)  # a stage-in: nothing to go on
    assert estimate.eta_seconds() is None
    estimate.step_done(1.95, 19.9)  # 2 of 10 done in 20 s of a thread: 8 more, on 2 threads
    assert estimate.eta_seconds() == 40.0
    assert [format_seconds(s) for s in (0.2, 40, 89, 150, 3 * 3600 + 300)] == ["1 s", "40 s", "89 s", "2 min",
                                                                               "3 h 5 min"]


def test_a_progress_line_says_the_phase_the_count_and_the_time_left():
    start = PrecompileProgress(PrecompilePhase.COMPILING, 0, 51, 0.0)
    assert start.describe() == ("compiling programs: 0 of 51 done, the time left is estimated once the first "
                                "programs are done")
    middle = PrecompileProgress(PrecompilePhase.COMPILING, 12, 51, 30.0, eta_seconds=170.0)
    assert middle.describe() == "compiling programs: 12 of 51 done, about 3 min left"
    done = PrecompileProgress(PrecompilePhase.COMPILING, 51, 51, 200.0, eta_seconds=0.0)
    assert done.describe() == "compiling programs: 51 of 51 done"
    runs = PrecompileProgress(PrecompilePhase.FIRST_RUNS, 3, 13, 1.0)
    assert runs.describe() == "first runs of the compiled programs: 3 of 13 started"
    waiting = PrecompileProgress(PrecompilePhase.FIRST_RUNS, 13, 13, 2.0)
    assert waiting.describe() == "first runs of the compiled programs: 13 of 13 started, waiting for them to finish"


def test_an_engine_reports_each_program_then_its_first_runs():
    events: list[PrecompileProgress] = []
    engine = tiny_engine(**SMALL)
    report = engine.precompile(events.append)
    compiling = [e for e in events if e.phase is PrecompilePhase.COMPILING]
    runs = [e for e in events if e.phase is PrecompilePhase.FIRST_RUNS]
    assert events == compiling + runs  # the phases in order
    assert [e.done for e in compiling] == list(range(report.num_programs + 1))
    assert {e.total for e in compiling} == {report.num_programs}
    assert {e.key for e in compiling[1:]} == set(engine.runner.compilation.compiled_keys)
    assert compiling[0].eta_seconds is None and any(e.eta_seconds is not None for e in compiling[1:-1])
    assert [e.done for e in runs] == [0, 1] and runs[-1].total == 1  # one bucket: one forward to run


def test_llm_shows_its_start_on_a_progress_bar(capsys):
    from orca_jax import LLM

    LLM("tiny-llama", max_num_seqs=2, max_num_batched_tokens=8, page_size=4, num_kv_pages=16)  # SMALL: cached
    shown = capsys.readouterr().err
    assert "loading tiny-llama" in shown and "compiling programs" in shown and "first runs" in shown
    LLM("tiny-llama", max_num_seqs=2, max_num_batched_tokens=8, page_size=4, num_kv_pages=16, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_a_progress_that_raises_cancelled_stops_the_precompile_after_that_program():
    """What a server told to stop while compiling does: the programs not begun are dropped (Ctrl-C during a
    four-minute start once waited for all of them)."""
    import pytest

    from orca_jax.worker.precompile_progress import PrecompileCancelled

    engine = tiny_engine(**SMALL)
    keys = engine.program_keys()

    def stop_after_the_first(event: PrecompileProgress) -> None:
        if event.done == 1:
            raise PrecompileCancelled

    with pytest.raises(PrecompileCancelled):
        engine.runner.compilation.precompile(keys, stop_after_the_first)
    assert engine.runner.compilation.num_compiled_programs == 1 < len(keys)
