"""The device's batch defaults: one table, the usage picks the column, an explicit value wins."""

import jax

from orca_jax.engine.defaults import BatchDefaults, UsageContext, batch_defaults, batch_defaults_for
from orca_jax.models.presets import get_preset
from orca_jax.server.cli_args import engine_config_from_args, parse_args

ON_CPU = jax.default_backend() == "cpu"  # the suite also runs on a GPU machine (make test there)


def test_the_table_by_device_and_usage():
    h100 = 59.0  # GiB XLA may take of an 80 GB GPU at jax's default fraction
    assert batch_defaults_for("gpu", h100, UsageContext.OFFLINE, 8.0e9) == BatchDefaults(256, 8192)
    assert batch_defaults_for("gpu", h100, UsageContext.SERVER, 8.0e9) == BatchDefaults(256, 4096)
    # A small model is host-bound on a large GPU: a smaller token budget.
    assert batch_defaults_for("gpu", h100, UsageContext.OFFLINE, 1.2e9) == BatchDefaults(256, 2048)
    assert batch_defaults_for("gpu", h100, UsageContext.SERVER, 1.2e9) == BatchDefaults(256, 2048)
    assert batch_defaults_for("gpu", 18.0, UsageContext.SERVER) == BatchDefaults(128, 2048)
    assert batch_defaults_for("cpu", 24.0, UsageContext.OFFLINE) == BatchDefaults(64, 512)
    assert batch_defaults_for("tpu", 16.0, UsageContext.OFFLINE) == BatchDefaults(64, 512)
    if ON_CPU:
        assert batch_defaults(UsageContext.OFFLINE, 8.0e9) == BatchDefaults(64, 512)
    else:  # the row of this device's platform and the memory XLA may take of it
        device = jax.devices()[0]
        gib = device.memory_stats()["bytes_limit"] / 2**30
        assert batch_defaults(UsageContext.OFFLINE, 8.0e9) == batch_defaults_for(device.platform, gib,
                                                                                 UsageContext.OFFLINE, 8.0e9)


def test_serve_takes_the_devices_defaults_unless_told():
    server = BatchDefaults(256, 4096)
    assert engine_config_from_args(parse_args([]), server).scheduler.max_num_seqs == 256
    given = engine_config_from_args(parse_args(["--max-num-seqs", "32", "--long-prefill-token-threshold", "512"]),
                                    server).scheduler
    assert (given.max_num_seqs, given.max_num_batched_tokens, given.long_prefill_token_threshold) == (32, 4096, 512)
    assert engine_config_from_args(parse_args([])).scheduler.max_num_batched_tokens == 512  # no device: the CPU's


def test_llm_takes_the_devices_defaults_unless_told():
    from orca_jax import LLM, SamplingParams

    device = batch_defaults(UsageContext.OFFLINE, get_preset("tiny-llama").num_params)  # (64, 512) on a CPU
    assert not ON_CPU or device == BatchDefaults(64, 512)
    # Nothing precompiled: compiling every program of two engines took 41 s of this suite.
    assert LLM("tiny-llama", num_kv_pages=16, precompile=False).engine.config.scheduler.max_num_seqs == \
        device.max_num_seqs
    llm = LLM("tiny-llama", num_kv_pages=16, max_num_seqs=8, precompile=False)
    assert not llm.engine.config.precompile
    scheduler = llm.engine.config.scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (8, device.max_num_batched_tokens)
    # Nothing compiled yet; generate compiles what its batches need, then answers.
    assert llm.engine.runner.compilation.num_compiled_programs == 0
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out.token_ids) == 2 and llm.engine.runner.compilation.num_compiled_programs > 0
