"""Fine-tuning from an attacker (tiny-llama, random weights, byte tokenizer): numbers non-finite or
out of range refused with the field and the range and no job created; a job whose training goes
non-finite fails instead of serving NaN; a job.json or events file holding NaN lists as null; uploads
bounded in depth and messages, linear to check, U+2028 accepted, and given up on cancel or shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import numpy as np
import pytest

from orca_jax.engine import Engine
from orca_jax.finetune.data import ValidationStopped, read_jsonl
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.models.loader import LoadedModel, load_model
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.app import create_app
from orca_jax.tokenizer import ByteTokenizer

from tests.helpers.finetune import RECORDS, drive, engine_config, upload
from tests.helpers.server import asgi_client

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
DATASET = (json.dumps(CHAT) + "\n").encode() * 4


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


def _upload(client, data: bytes):
    return client.post("/v1/files", files={"file": ("d.jsonl", data)}, data={"purpose": "fine-tune"})


@pytest.mark.parametrize("body, field, rule", [
    ({"hyperparameters": {"learning_rate_multiplier": float("nan")}}, "learning_rate_multiplier", r"\(0, 100\]"),
    ({"hyperparameters": {"learning_rate_multiplier": float("inf")}}, "learning_rate_multiplier", r"\(0, 100\]"),
    ({"hyperparameters": {"learning_rate_multiplier": 1e9}}, "learning_rate_multiplier", r"\(0, 100\]"),
    ({"method": {"supervised": {"hyperparameters": {"learning_rate_multiplier": float("-inf")}}}},
     "learning_rate_multiplier", r"\(0, 100\]"),
    ({"hyperparameters": {"warmup_ratio": float("nan")}}, "warmup_ratio", r"\[0, 1\)"),
    ({"hyperparameters": {"weight_decay": 5}}, "weight_decay", r"\[0, 1\]"),
    ({"hyperparameters": {"n_epochs": 10**9}}, "n_epochs", r"at most 100 on this server \(--fine-tuning-max-epochs\)"),
    ({"hyperparameters": {"batch_size": 10**12}}, "batch_size", r"at most 1024 .*--fine-tuning-max-batch-size"),
    ({"hyperparameters": {"micro_batch_tokens": 10**12}}, "micro_batch_tokens",
     r"at most 32768 .*--fine-tuning-max-micro-batch-tokens"),
    ({"lora": {"alpha": float("nan")}}, "lora.alpha", r"finite number"),
    ({"lora": {"alpha": 1e300}}, "lora.alpha", r"less than or equal to 65536"),
    ({"lora": {"rank": 10**12}}, "lora.rank", r"less than or equal to 65536"),
    ({"seed": -1}, "seed", r"greater than or equal to 0"),
])
def test_a_job_out_of_range_is_refused_naming_field_and_range_and_not_created(tiny, tmp_path, body, field, rule):
    engine = Engine(engine_config(str(tmp_path)), tiny)
    app = create_app(engine, served_model_name="tiny")

    async def scenario():
        async with asgi_client(app, timeout=60) as client:
            file_id = (await _upload(client, DATASET)).json()["id"]
            start = time.monotonic()
            # json.dumps writes NaN and Infinity as Python's JSON does (what the client sent).
            answer = await client.post("/v1/fine_tuning/jobs", content=json.dumps(
                {"model": "tiny", "training_file": file_id, **body}), headers={"content-type": "application/json"})
            assert time.monotonic() - start < 2
            assert answer.status_code == 400, answer.text
            message = answer.json()["error"]["message"]
            assert field.split(".")[-1] in message, message
            import re
            assert re.search(rule, message), message
            listing = await client.get("/v1/fine_tuning/jobs")
            assert listing.status_code == 200 and listing.json()["data"] == []

    asyncio.run(scenario())


def test_the_limits_are_flags():
    from orca_jax.server.cli_args import parse_args
    from orca_jax.server.fine_tuning import fine_tuning_config_from_args

    args = parse_args(["--enable-fine-tuning", "--fine-tuning-max-epochs", "500", "--fine-tuning-max-batch-size", "8",
                       "--fine-tuning-max-micro-batch-tokens", "65536", "--fine-tuning-max-example-messages", "16"])
    config = fine_tuning_config_from_args(args)
    assert (config.max_epochs, config.max_batch_size, config.max_micro_batch_tokens, config.max_example_messages) \
        == (500, 8, 65536, 16)


E_ACUTE = "é".encode()[0]  # 0xC3: the byte tokenizer's first token of "é"


def _params_with_a_nan_token(config) -> dict:
    """Random tiny-llama weights (norm scales 1) whose embedding row E_ACUTE is NaN (a byte no
    healthy request generates: logit_bias keeps it out)."""
    import jax

    from orca_jax.models.weights import expected_shapes

    rng = np.random.default_rng(0)

    def leaf(path, shape):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(shape, np.float32)
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(leaf, expected_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    params["embed"][E_ACUTE] = np.nan
    return params


def test_a_job_whose_loss_turns_nan_fails_and_its_adapter_is_never_served(tmp_path):
    """The second line behind the checks above: training on a token whose embedding is NaN (the
    loss is NaN from the first step) ends the job with an error; nothing is served, listing works and
    the base model answers as before."""
    import dataclasses

    from orca_jax.models import presets

    config = dataclasses.replace(presets.PRESETS["tiny-llama"], tie_embeddings=False)
    loaded = LoadedModel(config, _params_with_a_nan_token(config),
                         ByteTokenizer(config.eos_token_ids, config.bos_token_id))
    engine = Engine(engine_config(str(tmp_path)), loaded)
    tuner = engine.fine_tuning
    file_id = upload(tuner, [{"prompt": "caf", "completion": "é au lait"}] * 4)
    hp = TrainingHyperparameters(n_epochs=2, batch_size=4, micro_batch_tokens=64)
    job_id = tuner.create_job(file_id, hp, rank=4)["id"]
    drive(engine, lambda: tuner.job(job_id)["status"] in ("succeeded", "failed", "cancelled"))
    job = tuner.job(job_id)
    assert job["status"] == "failed" and job["fine_tuned_model"] is None, job
    assert "training diverged" in job["error"]["message"]
    assert tuner.served() == {} and engine.list_loras() == []
    json.dumps(tuner.jobs(), allow_nan=False)  # what GET /v1/fine_tuning/jobs sends
    json.dumps(tuner.store.events(job_id), allow_nan=False)
    no_e = SamplingParams(max_tokens=3, temperature=0, logit_bias=((E_ACUTE, -100.0),))
    engine.add_request([5, 6, 7], no_e, request_id="base")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["base"].finish_reason == "length"


def test_a_job_json_holding_nan_does_not_break_listing(tiny, tmp_path):
    engine = Engine(engine_config(str(tmp_path)), tiny)
    tuner = engine.fine_tuning
    file_id = upload(tuner, RECORDS)
    job_id = tuner.create_job(file_id, TrainingHyperparameters(n_epochs=1, batch_size=4, micro_batch_tokens=64),
                              rank=4)["id"]
    tuner.cancel(job_id)
    saved = json.loads((tmp_path / "jobs" / job_id / "job.json").read_text())
    # As an older version wrote them: a NaN setting (the job cannot be read back) and a NaN loss.
    bad_setting = {**saved, "id": "ftjob-nansetting", "hyperparameters": {**saved["hyperparameters"],
                                                                          "learning_rate_multiplier": float("nan")}}
    bad_loss = {**saved, "id": "ftjob-nanloss", "train_loss": float("nan")}
    for job in (bad_setting, bad_loss):
        os.makedirs(tmp_path / "jobs" / job["id"])
        (tmp_path / "jobs" / job["id"] / "job.json").write_text(json.dumps(job))
        (tmp_path / "jobs" / job["id"] / "events.jsonl").write_text(json.dumps(
            {"object": "fine_tuning.job.event", "id": "e", "created_at": 0, "level": "info", "message": "m",
             "data": {"train_loss": float("nan")}, "type": "metrics"}) + "\n")
    restarted = Engine(engine_config(str(tmp_path)), tiny)
    app = create_app(restarted, served_model_name="tiny")

    async def scenario():
        async with asgi_client(app) as client:
            listing = await client.get("/v1/fine_tuning/jobs")
            assert listing.status_code == 200, listing.text
            jobs = {job["id"]: job for job in listing.json()["data"]}
            assert set(jobs) == {job_id, "ftjob-nanloss"}  # the unreadable one is left out (and logged)
            assert jobs["ftjob-nanloss"]["train_loss"] is None
            events = await client.get("/v1/fine_tuning/jobs/ftjob-nanloss/events")
            assert events.status_code == 200 and events.json()["data"][0]["data"]["train_loss"] is None
            cancel = await client.post("/v1/fine_tuning/jobs/ftjob-nanloss/cancel")
            assert cancel.status_code == 400  # already cancelled: a 4xx, not a 500

    asyncio.run(scenario())


def test_uploads_deep_or_huge_chats_are_refused_fast_and_u2028_is_json(tiny, tmp_path):
    engine = Engine(engine_config(str(tmp_path)), tiny)
    app = create_app(engine, served_model_name="tiny")
    turns = []
    for _ in range(2000):  # ~100 KB, 2,000 assistant turns (validated for 15 minutes before)
        turns += [{"role": "user", "content": "x" * 20}, {"role": "assistant", "content": "y" * 20}]
    cases = {
        "deep": ('{"prompt": "a", "completion": "b", "x": ' + "[" * 5000 + "]" * 5000 + "}",
                 "line 1: JSON nests arrays and objects more than 64 levels deep"),
        "turns": (json.dumps({"messages": turns}),
                  "line 1: 4000 messages, more than the 256 an example may have on this server"),
        "nan": ('{"prompt": "a", "completion": "b", "weight": NaN}', "line 1: JSON: NaN is not a JSON number"),
    }

    async def scenario():
        async with asgi_client(app, timeout=60) as client:
            for name, (line, message) in cases.items():
                start = time.monotonic()
                answer = await _upload(client, line.encode() + b"\n")
                assert answer.status_code == 400, (name, answer.text)
                assert answer.json()["error"]["message"].startswith("invalid training file: " + message), answer.text
                assert time.monotonic() - start < 2, name
            separator = json.dumps({"prompt": "a\u2028b\u2029c", "completion": "d"}, ensure_ascii=False)
            assert (await _upload(client, separator.encode() + b"\n")).status_code == 200

    asyncio.run(scenario())


def test_many_turns_within_the_limits_are_checked_in_linear_time(tiny):
    """The chat template used to be rendered and tokenized once per assistant turn over the whole
    conversation before it; now the conversation is tokenized once."""
    tokenizer = tiny.tokenizer
    turns = []
    for i in range(120):
        turns += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    start = time.monotonic()
    (example,) = read_jsonl(json.dumps({"messages": turns}), tokenizer, 4096)
    assert time.monotonic() - start < 2
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=False)
    learned = bytes(t for t, keep in zip(example.token_ids, example.learned) if keep).decode()
    assert learned == "".join(f"a{i}\n" for i in range(120))  # each answer and its line break, nothing else
    assert bytes(example.token_ids).decode() == text


def test_checking_stops_when_asked(tiny):
    lines = (json.dumps(CHAT) + "\n") * 50
    calls = []

    def stop_after_ten():
        calls.append(1)
        return len(calls) > 10

    with pytest.raises(ValidationStopped):
        read_jsonl(lines, tiny.tokenizer, 512, should_stop=stop_after_ten)
    assert len(calls) == 11


def test_a_cancelled_validation_frees_the_data_thread(tiny, tmp_path):
    """Cancelling a job whose file is still being checked stops the check: the next job is validated."""
    engine = Engine(engine_config(str(tmp_path)), tiny)
    tuner = engine.fine_tuning
    slow = upload(tuner, [CHAT] * 20000)
    quick = upload(tuner, RECORDS)
    hp = TrainingHyperparameters(n_epochs=1, batch_size=4, micro_batch_tokens=64)
    first = tuner.create_job(slow, hp, rank=4)["id"]
    time.sleep(0.2)
    assert tuner.job(first)["status"] == "validating_files"
    tuner.cancel(first)
    second = tuner.create_job(quick, hp, rank=4)["id"]
    deadline = time.monotonic() + 10
    while tuner.job(second)["status"] == "validating_files":
        assert time.monotonic() < deadline, "the cancelled job's check held the data thread"
        time.sleep(0.02)
    assert tuner.job(first)["status"] == "cancelled"


def test_an_upload_is_given_up_with_a_503_when_the_server_shuts_down(tiny, tmp_path):
    engine = Engine(engine_config(str(tmp_path)), tiny)
    app = create_app(engine, served_model_name="tiny")
    big = (json.dumps(CHAT) + "\n").encode() * 20000

    async def scenario():
        async with asgi_client(app, timeout=60) as client:
            uploading = asyncio.ensure_future(_upload(client, big))
            await asyncio.sleep(0.1)
            start = time.monotonic()
            app.state.async_engine.begin_shutdown()  # what SIGTERM does first
            answer = await uploading
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down", answer.text
            assert time.monotonic() - start < 2

    asyncio.run(scenario())
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncio_")]  # no check left running
