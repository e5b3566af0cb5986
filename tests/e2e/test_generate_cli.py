"""`python -m orca_jax.generate`: stdout is the prompt and its continuation, nothing else."""

import subprocess
import sys
from pathlib import Path

from orca_jax.config import EngineConfig
from orca_jax.engine import Engine
from orca_jax.sampling_params import SamplingParams
from tests.helpers.process import checkout_env

REPO = Path(__file__).resolve().parents[2]


def _generate(*argv: str, cache_dir) -> subprocess.CompletedProcess:
    # A JAX cache of its own: conftest's session cache keeps even tiny programs, and an XLA:CPU one
    # written by another process of the session failed to load here ("Function iota_reduce_fusion
    # not found"), depending on test order.
    env = checkout_env(JAX_COMPILATION_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-m", "orca_jax.generate", *argv], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=300)


def test_stdout_holds_the_text_alone_and_logs_go_to_stderr(tmp_path):
    engine = Engine(EngineConfig(model="tiny-llama", dtype="float16", precompile=False))
    engine.add_request(engine.tokenizer.encode_prompt("Hi"), SamplingParams(max_tokens=6))
    expected = ""
    while engine.has_unfinished():
        expected += "".join(out.new_text for out in engine.step())
    quiet = _generate("--model", "tiny-llama", "--dtype", "float16", "--max-tokens", "6", "Hi", cache_dir=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "Hi" + expected + "\n"
    assert "6 generated" in quiet.stderr and "compiling" not in quiet.stderr  # warnings only when asked
    chatty = _generate("--model", "tiny-llama", "--max-tokens", "2", "--log-level", "warning", "Hi",
                       cache_dir=tmp_path)
    assert "compiling" in chatty.stderr and "compiling" not in chatty.stdout


def test_a_hub_id_gets_one_line(tmp_path):
    result = _generate("--model", "meta-llama/Llama-3.2-1B", "Hi", cache_dir=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].endswith("then pass --model DIR")
    assert "Traceback" not in result.stderr
