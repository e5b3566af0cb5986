"""OpenAI's files and fine-tuning API end to end on a tiny model: the official client uploads a chat
dataset, a job learns it and its fine_tuned_model answers at once; events, checkpoints, cancel, the
400s (a bad line named), the API key, metrics; `serve --enable-fine-tuning` resumes and serves across
a restart."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time

import httpx
import pytest

from orca_jax.engine import Engine
from orca_jax.models.loader import load_model
from orca_jax.server.app import create_app

from tests.helpers.finetune import engine_config
from tests.helpers.hf_dirs import write_hf_dir
from tests.helpers.process import ROOT, OutputDrained, checkout_env, free_port, wait_healthy
from tests.helpers.server import asgi_client, live_server

KEY = "sekrit"
CHATS = [("The quick", "fox"), ("Once upon", "robot"), ("def f", "return"), ("What is", "Paris")]
DATASET = "".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                  + "\n" for q, a in CHATS).encode()
HYPER = {"n_epochs": 40, "batch_size": 4, "learning_rate_multiplier": 50, "warmup_ratio": 0.0,
         "micro_batch_tokens": 128}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    write_hf_dir(directory, "llama")
    return directory


@pytest.mark.slow  # ~30 s: the job's programs and the adapter's forward compile
def test_official_client_fine_tunes_and_serves(base_dir, tmp_path):
    openai = pytest.importorskip("openai")
    engine = Engine(engine_config(str(tmp_path)), load_model(base_dir))
    app = create_app(engine, api_key=KEY, served_model_name="tiny")
    with live_server(app) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        uploaded = client.files.create(file=("chats.jsonl", io.BytesIO(DATASET)), purpose="fine-tune")
        assert uploaded.bytes == len(DATASET) and uploaded.purpose == "fine-tune"
        assert client.files.retrieve(uploaded.id).filename == "chats.jsonl"
        job = client.fine_tuning.jobs.create(model="tiny", training_file=uploaded.id, suffix="chat",
                                             hyperparameters={"n_epochs": 40, "batch_size": 4,
                                                              "learning_rate_multiplier": 50},
                                             extra_body={"lora": {"rank": 8, "alpha": 16}})
        assert job.status in ("validating_files", "queued") and job.hyperparameters.n_epochs == 40
        deadline = time.monotonic() + 120
        while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert job.status == "succeeded", job.error
        assert job.fine_tuned_model.startswith("ft:tiny:chat:") and job.trained_tokens > 0
        assert [j.id for j in client.fine_tuning.jobs.list().data] == [job.id]
        events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
        losses = [e.data["train_loss"] for e in reversed(events) if e.type == "metrics"]
        assert len(losses) == 40 and losses[-1] < 0.5 * losses[0]
        checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
        assert [c.step_number for c in checkpoints] == [40, 39, 38]  # one per epoch, the newest 3 kept
        assert job.fine_tuned_model in [m.id for m in client.models.list().data]
        for question, answer in CHATS:
            reply = client.chat.completions.create(model=job.fine_tuned_model, max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": question}])
            assert reply.choices[0].message.content.strip() == answer
        base = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": CHATS[0][0]}])
        assert base.choices[0].message.content.strip() != CHATS[0][1]


def test_errors_cancel_auth_and_metrics(base_dir, tmp_path):
    engine = Engine(engine_config(str(tmp_path), max_epochs=1000), load_model(base_dir))  # a job that runs on
    app = create_app(engine, api_key=KEY, served_model_name="tiny")
    auth = {"Authorization": f"Bearer {KEY}"}

    async def scenario():
        async with asgi_client(app, headers=auth, timeout=120) as client:
            def upload(data: bytes, purpose: str = "fine-tune"):
                return client.post("/v1/files", files={"file": ("d.jsonl", data)}, data={"purpose": purpose})

            bad_lines = [DATASET.splitlines()[0], b'{"messages": [{"role": "user", "content": "hi"}, {"role": "bot"}]}']
            bad = await upload(b"\n".join(bad_lines))
            assert bad.status_code == 400 and bad.json()["error"]["message"].startswith(
                "invalid training file: line 2: messages[1].role must be one of system, user, assistant")
            assert (await upload(b"{not json")).json()["error"]["message"].startswith(
                "invalid training file: line 1: not valid JSON")
            assert (await upload(DATASET, purpose="assistants")).json()["error"]["code"] == "invalid_purpose"
            assert (await client.post("/v1/files", headers={"Authorization": "Bearer no"},
                                      files={"file": ("d.jsonl", DATASET)}, data={"purpose": "fine-tune"})).status_code == 401
            file_id = (await upload(DATASET)).json()["id"]

            def create(**body):
                return client.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id, **body})

            for body, problem in [({"training_file": "file-nope"}, "no file 'file-nope'"),
                                  ({"model": "other"}, "neither the base model 'tiny' nor a served adapter"),
                                  ({"lora": {"rank": 64}}, "LoRA rank 64 is above the server's maximum (8"),
                                  ({"lora": {"target_modules": ["embed_tokens"]}}, "unknown LoRA target module"),
                                  ({"hyperparameters": {"n_epochs": 0}}, "n_epochs must be an integer from 1")]:
                response = await create(**body)
                assert response.status_code == 400 and problem in response.json()["error"]["message"], response.text
            assert (await client.get("/v1/fine_tuning/jobs/ftjob-nope")).status_code == 404

            job = (await create(hyperparameters={**HYPER, "n_epochs": 1000})).json()
            while (current := (await client.get(f"/v1/fine_tuning/jobs/{job['id']}")).json())["step"] < 2:
                await asyncio.sleep(0.05)
            cancelled = (await client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")).json()
            assert cancelled["status"] == "cancelled" and current["status"] == "running"
            again = await client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
            assert again.status_code == 400 and "already cancelled" in again.json()["error"]["message"]
            events = (await client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 2})).json()
            assert events["has_more"] and events["data"][0]["message"] == "Fine-tuning job cancelled"
            metrics = (await client.get("/metrics")).text
            assert 'orca_jax:fine_tuning_jobs{model_name="tiny",status="cancelled"} 1.0' in metrics
            tokens = next(line for line in metrics.splitlines() if line.startswith("orca_jax:fine_tuning_tokens_total"))
            assert float(tokens.split()[-1]) > 0
            loans = next(line for line in metrics.splitlines() if line.startswith("orca_jax:kv_loans_total"))
            assert float(loans.split()[-1]) >= 1  # the job borrowed the pool's top pages

    asyncio.run(scenario())


@pytest.mark.slow  # two server processes and a job (~60 s on a busy 2-core machine)
def test_serve_cli_fine_tunes_and_serves_after_a_restart(base_dir, tmp_path, tmp_path_factory):
    port = free_port()
    command = [sys.executable, "-m", "orca_jax.serve", "--model", base_dir, "--port", str(port), "--page-size", "128",
               "--num-kv-pages", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "8", "--attention-backend",
               "jnp", "--log-level", "warning", "--enable-fine-tuning", "--fine-tuning-dir", str(tmp_path),
               "--max-lora-rank", "8", "--fine-tuning-deferral-bound-s", "0.2", "--api-key", KEY,
               "--fine-tuning-memory-policy", "reserve",  # the other policy than the in-process tests
               "--fine-tuning-tpot-slo-ms", "50"]
    # A JAX cache of the two servers' own (as test_generate_cli.py's): an XLA:CPU program another process
    # of the session wrote to conftest's session cache failed to load in the restarted server ("Function
    # iota_reduce_fusion not found"), depending on which tests ran before in this process.
    env = checkout_env(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla")))
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}

    def serve():
        process = OutputDrained(command, cwd=ROOT, env=env)
        wait_healthy(url, process, timeout=300)
        return process

    process = serve()
    try:
        file_id = httpx.post(url + "/v1/files", headers=auth, files={"file": ("d.jsonl", DATASET)},
                             data={"purpose": "fine-tune"}).json()["id"]
        job = httpx.post(url + "/v1/fine_tuning/jobs", headers=auth, json={
            "model": base_dir, "training_file": file_id, "hyperparameters": HYPER, "lora": {"rank": 8}}).json()
        deadline = time.monotonic() + 180
        while (job := httpx.get(url + f"/v1/fine_tuning/jobs/{job['id']}", headers=auth).json())["status"] != "succeeded":
            assert job["status"] in ("validating_files", "queued", "running") and time.monotonic() < deadline, job
            time.sleep(0.2)
    finally:
        process.terminate()
        process.communicate(timeout=60)
    process = serve()  # the finished adapter is served again from the fine-tuning directory
    try:
        models = [m["id"] for m in httpx.get(url + "/v1/models", headers=auth).json()["data"]]
        assert models == [base_dir, job["fine_tuned_model"]]
        reply = httpx.post(url + "/v1/chat/completions", headers=auth, timeout=60, json={
            "model": job["fine_tuned_model"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": CHATS[0][0]}]}).json()
        assert reply["choices"][0]["message"]["content"].strip() == CHATS[0][1]
    finally:
        process.terminate()
        process.communicate(timeout=60)
