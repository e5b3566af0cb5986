"""The job store on disk: a job saved from several threads at once (the engine thread, the thread
reading its file, a caller cancelling it) ends as one whole, readable job.json, and nothing raises."""

import threading

from orca_jax.finetune.hparams import LoRASpec, TrainingHyperparameters
from orca_jax.finetune.jobs import FineTuningJob, JobStore


def test_saves_from_several_threads_at_once(tmp_path):
    store = JobStore(str(tmp_path))
    job = FineTuningJob("ftjob-1", "base", "file-1", LoRASpec(4, 8.0, ("q_proj",)), TrainingHyperparameters(), 0)
    errors = []

    def save(n):
        try:
            for i in range(200):
                job.trained_tokens = n * 1000 + i
                store.save_job(job)
        except Exception as error:  # the old shared temporary file: FileNotFoundError in os.replace
            errors.append(error)

    threads = [threading.Thread(target=save, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    [loaded] = store.load_jobs()
    assert loaded.id == job.id and loaded.trained_tokens == job.trained_tokens  # the newest state won
    assert sorted(p.name for p in (tmp_path / "jobs" / "ftjob-1").iterdir()) == ["job.json"]  # no stray temporaries
