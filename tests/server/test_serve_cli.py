"""`python -m orca_jax.serve`'s command line without serving: help, --config, and flag errors."""

import re

import pytest

from orca_jax.server.cli_args import (build_parser, engine_config_from_args, http_limits_from_args, parse_args,
                                      read_chat_template, string_list)
from orca_jax.server.http_limits import HTTPLimits


def test_help_shows_every_real_default_and_no_placeholder(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "(default: None)" not in text and "(default: --model)" not in text
    for action in build_parser()._actions:
        if action.help is None:
            assert action.dest == "help"
            continue
        shown = action.default is not None and (action.nargs != 0 or "BooleanOptional" in type(action).__name__)
        if shown:
            default = action.default if not isinstance(action.default, tuple) else ",".join(action.default)
            assert f"(default: {default})" in text, action.option_strings
    for preset in ("smollm2-135m (real weights)", "tiny-llama", "llama-8b"):
        assert preset in text
    assert "a Llama .gguf file" in text and "Hub id" in text


def test_a_config_file_sets_flags_and_the_command_line_overrides_it(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 8\nmax_num_batched_tokens: 64\npriority-preemption: false\n"
                      "disable-log-requests: true\nallowed-origins: [https://a.example, https://b.example]\n"
                      "dtype: float16\nheader-timeout-s: 2.5\n")
    args = parse_args(["--config", str(config), "--max-num-seqs", "4"])
    engine = engine_config_from_args(args)
    assert engine.scheduler.max_num_seqs == 4 and engine.scheduler.max_num_batched_tokens == 64
    assert not engine.scheduler.priority_preemption and engine.dtype == "float16"
    assert args.disable_log_requests and args.allowed_origins == ("https://a.example", "https://b.example")
    assert http_limits_from_args(args) == HTTPLimits(header_timeout_s=2.5)


@pytest.mark.parametrize("text, message", [
    ("no-such-flag: 1\n", "unknown flag 'no-such-flag'"),
    ("disable-log-requests: 3\n", "takes true or false"),
    ("- a list\n", "expected a mapping"),
])
def test_a_bad_config_file_is_a_flag_error(tmp_path, capsys, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--model", "meta-llama/Llama-3.2-1B"], "hf download meta-llama/Llama-3.2-1B --local-dir DIR"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--root-path", "llm/"], "--root-path must start with /"),
    (["--chat-template", "no_such_file.jinja"], "no such file, and not an inline jinja template"),
    (["--chat-template", "{% for m in messages %}"], "Unexpected end of template"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["--header-timeout-s", "0"], "header_timeout_s must be positive"),
    (["--default-max-tokens", "-1"], "--default-max-tokens must be 0"),
    (["--enable-fine-tuning", "--fine-tuning-tpot-slo-ms", "0"], "tpot_slo_ms must be positive"),
    (["--enable-fine-tuning", "--pipeline-parallel-size", "2"], "tensor parallelism is supported; pipeline stages"),
])
def test_flag_errors_are_one_line_not_a_traceback(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m orca_jax.serve: error: ") and message in error


def test_chat_templates_come_from_a_file_or_inline(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{% for")
    assert read_chat_template(None) is None


def test_fine_tuning_flags_reach_the_config():
    config = engine_config_from_args(parse_args(["--enable-fine-tuning", "--fine-tuning-tpot-slo-ms", "40",
                                                 "--fine-tuning-max-inference-slowdown", "1.5"])).fine_tuning
    assert config.tpot_slo_ms == 40.0 and config.max_inference_slowdown == 1.5
    assert engine_config_from_args(parse_args(["--enable-fine-tuning"])).fine_tuning.tpot_slo_ms is None
    tensor = engine_config_from_args(parse_args(["--enable-fine-tuning", "--tensor-parallel-size", "2"]))
    assert tensor.fine_tuning is not None and tensor.parallel.tensor_parallel == 2


def test_dtype_auto_is_the_checkpoints_and_lists_take_json_or_commas():
    assert engine_config_from_args(parse_args([])).dtype is None
    assert engine_config_from_args(parse_args(["--dtype", "bfloat16"])).dtype == "bfloat16"
    assert string_list('["a", "b"]') == string_list("a, b") == ("a", "b")
    assert parse_args([]).allowed_methods == ("*",) and parse_args([]).allowed_origins is None
