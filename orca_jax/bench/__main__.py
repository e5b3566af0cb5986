"""`python -m orca_jax.bench SUBCOMMAND`: see each subcommand's --help."""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

from orca_jax.bench.harness import fit_to_context
from orca_jax.help_format import DefaultsHelpFormatter

# name -> (module under orca_jax.bench, one line of help); each module has add_arguments(parser) and run(args).
SUBCOMMANDS = {
    "throughput": ("throughput", "offline tokens/s over datasets and scheduling choices, against the roofline"),
    "latency": ("latency", "a batch of identical requests; decode per iteration vs the weight-read bound"),
    "sweep": ("sweep", "latency vs throughput over arrival rates, ORCA vs request-level (the paper's Figure 10)"),
    "serve": ("serve", "load-test an OpenAI-compatible server over HTTP (--launch starts ours)"),
    "startup": ("startup", "cold and warm start: process start to every program compiled"),
    "kernel": ("kernel", "the ragged attention kernel: checked against its reference, then timed"),
    "plan": ("plan", "arithmetic: padding waste of a dataset, memory plan of a (tp, pp) mesh"),
    "report": ("report", "tables and plots from a results directory"),
    "peer": ("peer", "transformers' continuous batching on the same trace (run it in its own process)"),
    "multiturn": ("multiturn", "a multi-turn chat trace (and no-sharing and ORCA traces) with prefix caching on and off"),
    "lora": ("lora", "multi-LoRA serving: adapter terms per form, the ORCA trace over adapters vs the base"),
    "sampling": ("sampling", "the ORCA trace greedy, sampled, with penalties and under a JSON schema; host mask time"),
    "finetune": ("finetune", "inference and a LoRA fine-tuning job on one device (Deferred Continuous Batching): "
                 "TTFT/TPOT at three Poisson rates with and without the job, fine-tuning tokens/s"),
    "finetune-memory": ("finetune_memory", "a job's memory lent by the KV pool vs held back from it: the pool, the "
                        "job's rate, a burst that needs the pages back"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m orca_jax.bench", description=__doc__)
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(f"orca_jax.bench.{module_name}")
        child = sub.add_parser(name, help=help_text, description=module.__doc__, formatter_class=DefaultsHelpFormatter)
        module.add_arguments(child)
        child.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None):
    """Parse, then run the subcommand; returns what it returned (a Results, mostly)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = "python -m orca_jax.bench " + shlex.join(argv)
    if hasattr(args, "tensor_parallel_size"):  # before anything starts jax: XLA reads them then
        from orca_jax.config import ParallelConfig
        from orca_jax.worker import xla_setup
        xla_setup.prepare(ParallelConfig(tensor_parallel=args.tensor_parallel_size,
                                         num_stages=getattr(args, "pipeline_parallel_size", 1)))
    fit_to_context(args)  # before anything compiles: a request that cannot fit would end the run after it
    return args.handler(args)


if __name__ == "__main__":
    main()
