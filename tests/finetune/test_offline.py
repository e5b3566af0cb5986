"""LLM.fine_tune on a tiny model: the toy task is learned (loss well below its start, the adapter's greedy
answers become the trained ones), the adapter is served at once and loads in peft; bad datasets name
their line; a job resumes after a restart exactly where its checkpoint left it; cancel mid-job."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from orca_jax import LLM, SamplingParams
from orca_jax.engine import Engine
from orca_jax.finetune.data import DatasetError
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.finetune.offline import run_fine_tune
from orca_jax.models.loader import load_model

from tests.helpers.finetune import FAST, RECORDS, TOY, drive, engine_config, upload
from tests.helpers.hf_dirs import write_hf_dir

GREEDY = SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    write_hf_dir(directory, "llama")
    return load_model(directory)


def completions(llm_or_engine, lora):
    llm = llm_or_engine
    tokenizer = llm.tokenizer
    out = llm.generate([p for p, _ in TOY], GREEDY, lora_request=lora, use_tqdm=False)
    return [o.token_ids for o in out], [tokenizer.encode(c)[:GREEDY.max_tokens] for _, c in TOY]


def losses(tuner, job_id: str) -> list[float]:
    return [e["data"]["train_loss"] for e in tuner.store.events(job_id) if "train_loss" in e["data"]]


@pytest.mark.slow  # ~30 s: the engine's programs, the train step's, two jobs
def test_fine_tune_learns_the_toy_task(loaded, tmp_path):
    llm = LLM("tiny", loaded=loaded, enable_fine_tuning=True, fine_tuning_dir=str(tmp_path), max_lora_rank=8,
              attention_backend="jnp", num_kv_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    before, wanted = completions(llm, None)
    assert before != wanted
    lora = llm.fine_tune(RECORDS, hyperparameters=FAST, lora_rank=8, suffix="toy")
    tuner = llm.engine.fine_tuning
    assert tuner.store.root == str(tmp_path)
    [job] = tuner.jobs()
    assert job["status"] == "succeeded" and job["fine_tuned_model"] == lora.lora_name
    assert lora.lora_name.startswith("ft:tiny:toy:")
    curve = losses(tuner, job["id"])
    assert len(curve) == FAST.n_epochs and curve[-1] < 0.5 * curve[0], curve
    after, wanted = completions(llm, lora)
    assert after == wanted
    # The base model still answers as before (the adapter is one request's choice).
    assert completions(llm, None)[0] == before
    stats = llm.stats()
    assert stats.fine_tuning_iterations == FAST.n_epochs and stats.fine_tuning_tokens_total > 0
    # Trained further (its rank, alpha and targets kept), for one more epoch at a low rate: a new adapter
    # that still answers the same.
    again = llm.fine_tune(RECORDS, lora_request=lora, n_epochs=1, batch_size=4, learning_rate_multiplier=0.1,
                          use_tqdm=False)
    assert again.lora_name != lora.lora_name and again.lora_int_id != lora.lora_int_id
    continued = next(j for j in tuner.jobs() if j["fine_tuned_model"] == again.lora_name)
    assert continued["model"] == lora.lora_name and continued["lora"] == job["lora"]
    assert completions(llm, again)[0] == wanted


@pytest.mark.slow  # ~40 s: the FP8 engine's programs and a job
def test_fine_tune_on_an_fp8_base_learns_the_toy_task(loaded, tmp_path):
    """Adapters train in f32 over a base whose projections are stored as FP8 (models/fp8.py)."""
    llm = LLM("tiny", loaded=loaded, enable_fine_tuning=True, fine_tuning_dir=str(tmp_path), max_lora_rank=8,
              attention_backend="jnp", num_kv_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=16,
              quantization="fp8", kv_cache_dtype="fp8")
    lora = llm.fine_tune(RECORDS, hyperparameters=FAST, lora_rank=8, suffix="fp8")
    [job] = llm.engine.fine_tuning.jobs()
    curve = losses(llm.engine.fine_tuning, job["id"])
    assert job["status"] == "succeeded" and curve[-1] < 0.5 * curve[0], curve
    after, wanted = completions(llm, lora)
    assert after == wanted


def test_bad_dataset_names_the_line(loaded, tmp_path):
    llm = LLM(engine_config=engine_config(str(tmp_path)), loaded=loaded)
    bad = RECORDS[:2] + [{"prompt": "x"}] + RECORDS[2:]
    with pytest.raises(DatasetError, match=r"^line 3: 'prompt' must be a string and 'completion' a non-empty"):
        llm.fine_tune(bad, use_tqdm=False)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n\n" + '{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DatasetError, match="^line 3: no assistant message to learn"):
        llm.fine_tune(str(path), use_tqdm=False)
    assert llm.engine.fine_tuning.jobs() == []


def test_finished_adapter_loads_in_peft(loaded, tmp_path):
    """The saved directory is a peft adapter: transformers + peft give our logits with it."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    model_dir = tmp_path / "model"
    write_hf_dir(str(model_dir), "llama")
    llm = LLM(engine_config=engine_config(str(tmp_path / "jobs")), loaded=load_model(str(model_dir)))
    hp = TrainingHyperparameters(n_epochs=3, batch_size=2, learning_rate_multiplier=20, micro_batch_tokens=64)
    lora = llm.fine_tune(RECORDS, hyperparameters=hp, lora_rank=4, target_modules=["q_proj", "v_proj", "down_proj"],
                         use_tqdm=False)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, lora.lora_path).eval()
    ids = llm.tokenizer.encode_prompt(TOY[0][0])
    with torch.no_grad():
        theirs = tuned(torch.tensor([ids])).logits[0, -1].numpy()
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=5), lora_request=lora,
                       use_tqdm=False)[0]
    assert out.token_ids[0] == int(np.argmax(theirs))
    config = json.loads((open(os.path.join(lora.lora_path, "adapter_config.json"))).read())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]


def adapter_arrays(path: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def test_resume_after_restart_repeats_the_uninterrupted_run(loaded, tmp_path):
    """A job stopped mid-run (no shutdown, as a crash) resumes in a new engine from its newest checkpoint;
    its adapter equals that of a run never stopped."""
    hp = TrainingHyperparameters(n_epochs=2, batch_size=1, learning_rate_multiplier=10, micro_batch_tokens=64,
                                 checkpoint_every=3)  # 8 steps, checkpoints at 3 and 6
    whole = Engine(engine_config(str(tmp_path / "whole")), loaded)
    expected = run_fine_tune(whole, RECORDS, hyperparameters=hp, lora_request=None, rank=4, alpha=None,
                             target_modules=None, suffix=None, use_tqdm=False)

    first = Engine(engine_config(str(tmp_path / "resumed"), keep_checkpoints=1), loaded)
    tuner = first.fine_tuning
    file_id = upload(tuner, RECORDS)
    job_id = tuner.create_job(file_id, hp, rank=4)["id"]
    drive(first, lambda: tuner.job(job_id)["step"] >= 5)
    assert [c["step_number"] for c in tuner.checkpoints(job_id)] == [3]
    first = tuner = None  # stopped between checkpoints: steps 4 and 5 are lost

    second = Engine(engine_config(str(tmp_path / "resumed")), loaded)
    job = second.fine_tuning.job(job_id)
    assert job["status"] == "queued"
    drive(second, lambda: second.fine_tuning.job(job_id)["status"] in ("succeeded", "failed"))
    job = second.fine_tuning.job(job_id)
    assert job["status"] == "succeeded", job["error"]
    events = [e["message"] for e in second.fine_tuning.store.events(job_id)]
    assert any("Resumed from the checkpoint of step 3" in m for m in events)
    ours, theirs = adapter_arrays(second.fine_tuning.served()[job["fine_tuned_model"]].lora_path), \
        adapter_arrays(expected.lora_path)
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # The restarted engine serves what the first one finished, too: a third start serves both.
    third = Engine(engine_config(str(tmp_path / "resumed")), loaded)
    assert job["fine_tuned_model"] in third.fine_tuning.served()


def test_cancel_mid_job(loaded, tmp_path):
    engine = Engine(engine_config(str(tmp_path)), loaded)
    tuner = engine.fine_tuning
    file_id = upload(tuner, RECORDS)
    job_id = tuner.create_job(file_id, FAST, rank=4)["id"]
    drive(engine, lambda: tuner.job(job_id)["step"] >= 2)
    assert tuner.cancel(job_id)["status"] == "cancelled"
    assert not engine.has_work() and tuner.served() == {}
    with pytest.raises(ValueError, match="already cancelled"):
        tuner.cancel(job_id)
    assert tuner.jobs_by_status()["cancelled"] == 1
