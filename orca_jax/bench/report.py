"""`bench report DIR`: summary.md and plots from every result JSON in a directory.

Each result names the subcommand that wrote it ("bench"); that subcommand's `tables(result)` gives its
rows, so a number is formatted where it is measured. The headline table puts one model's numbers from
several results side by side (docs/benchmarks.md's: ORCA trace tokens/s, decode vs the weight-read bound,
warm start, HTTP over in-process, transformers). Files that are not results are listed, not read.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os

from orca_jax.bench.harness import on_off

PLOTS = ("throughput", "latency", "sweep", "kernel", "serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dir")
    parser.add_argument("--no-plots", action="store_true")


def load(results_dir: str) -> tuple[list[dict], list[str]]:
    """(results sorted by subcommand and model, names of the JSON files that are not results)."""
    results, others = [], []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and "bench" in data:
            results.append(data | {"file": os.path.basename(path)})
        else:
            others.append(os.path.basename(path))
    order = [module for module, _ in _subcommands().values()]
    return sorted(results, key=lambda r: (order.index(_module(r)), r.get("model") or "")), others


def _subcommands() -> dict:
    from orca_jax.bench.__main__ import SUBCOMMANDS

    return SUBCOMMANDS


def _module(result: dict) -> str:
    """The bench module of a result: its `bench` names the subcommand or (finetune_memory) the module."""
    commands = _subcommands()
    return commands[result["bench"]][0] if result["bench"] in commands else result["bench"]


def tables_of(result: dict) -> dict[str, list[dict]]:
    return importlib.import_module(f"orca_jax.bench.{_module(result)}").tables(result)


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value).replace("|", "&#124;").replace("\n", " ")


def markdown(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows for k in row if any(r.get(k) is not None for r in rows)))
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows])


def _first(rows, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def headline(results: list[dict]) -> list[dict]:
    """Per model: docs/benchmarks.md's numbers, from whichever results hold them."""
    out = {}
    for r in results:
        row = out.setdefault(r.get("model"), {"model": r.get("model"), "device": r.get("device")})
        if r["bench"] == "throughput":  # ORCA on the paper's trace: async scheduling and the largest cap first
            runs = [x for x in r.get("runs", []) if x["dataset"]["kind"] == "uniform" and x["scheduler"] == "orca"
                    and "note" not in x["dataset"]]
            best = max(runs, key=lambda x: (x["async_scheduling"] is not False, x["max_num_seqs"]), default=None)
            if best:
                row |= {"ORCA trace tok/s": best["runs"][-1]["tokens_per_s"], "of bound": best.get("fraction_of_bound")}
        elif r["bench"] == "latency":
            one = _first(r.get("rows", []), batch_size=1, async_scheduling=True)
            if one:
                row |= {"b1 decode ms": one["ms_per_iteration"], "weight-read bound ms": one["weight_bound_ms"]}
        elif r["bench"] == "startup":
            for label in ("cold", "warm"):
                start = _first(r.get("runs", []), label=label)
                if start and "process_to_ready_s" in start:
                    row[f"{label} start s"] = start["process_to_ready_s"]
        elif r["bench"] == "serve" and r.get("http_over_in_process") is not None:
            row["HTTP / in process"] = r["http_over_in_process"]
        elif r["bench"] == "peer" and r.get("offline"):
            row["transformers tok/s"] = r["offline"]["tokens_per_s"]
    for row in out.values():
        if row.get("ORCA trace tok/s") and row.get("transformers tok/s"):
            row["ours / transformers"] = row["ORCA trace tok/s"] / row["transformers tok/s"]
    order = ("model", "device", "ORCA trace tok/s", "of bound", "transformers tok/s", "ours / transformers",
             "HTTP / in process", "b1 decode ms", "weight-read bound ms", "cold start s", "warm start s")
    return [{k: row.get(k) for k in order} for row in out.values() if len(row) > 2]


def write_report(results_dir: str, plots: bool = True) -> str:
    """Write summary.md (and PNGs) into results_dir; returns the summary's path."""
    results, others = load(results_dir)
    lines = [f"# Benchmark results: {os.path.basename(os.path.abspath(results_dir))}", "",
             f"Made by `python -m orca_jax.bench report {results_dir}` from the JSON files here"
             + ("; `notes.md` says what they show." if os.path.exists(os.path.join(results_dir, "notes.md")) else "."), ""]
    if plots:
        lines += [f"![{name}]({name})" for name in draw(results, results_dir)] + [""]
    top = headline(results)
    if top:
        lines += ["## Headline", ""] + markdown(top) + [""]
    for r in results:
        lines += [f"## {r['bench']}: {r.get('model')} ({r['file']})", "",
                  f"{r.get('device') or r.get('platform')}" + (f", jax {r['jax']}" if r.get("jax") else "") + f", commit {r.get('commit')}; "
                  f"`{r.get('command')}`"
                  + (f"; converted from {r['converted_from']}" if r.get("converted_from") else ""), ""]
        for title, rows in tables_of(r).items():
            if rows:
                lines += [f"{title}:", ""] + markdown(rows) + [""]
    if others:
        lines += ["Not results (not read): " + ", ".join(others), ""]
    path = os.path.join(results_dir, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def draw(results: list[dict], out_dir: str) -> list[str]:
    """One PNG per kind of result that has something to plot; their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for kind in PLOTS:
        group = [r for r in results if r["bench"] == kind and _has_points(r)]
        if not group:
            continue
        fig, axes = plt.subplots(1, len(group), figsize=(5.5 * len(group), 4), squeeze=False)
        for ax, r in zip(axes[0], group):
            _plot(kind, r, ax)
            ax.set_title(f"{r.get('model')} ({r.get('device')})", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.suptitle(kind)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{kind}.png"), dpi=110)
        plt.close(fig)
        made.append(f"{kind}.png")
    return made


def _has_points(r: dict) -> bool:
    if r["bench"] == "throughput":
        return any(x.get("tok/s") for x in tables_of(r)["runs"])
    key = {"latency": "rows", "sweep": "points", "kernel": "decode", "serve": "requests"}[r["bench"]]
    return isinstance(r.get(key), list) and bool(r[key])


def _plot(kind: str, r: dict, ax) -> None:
    if kind == "throughput":
        rows = [x for x in tables_of(r)["runs"] if x.get("tok/s")]
        labels = [f"{x['dataset'][:14]} {x['scheduler'][:7]} {x['max_num_seqs']} {x['async'] or ''}" for x in rows]
        ax.barh(labels, [x["tok/s"] for x in rows], label="measured")
        ax.barh(labels, [x["bound tok/s"] or 0 for x in rows], fill=False, edgecolor="k", label="roofline bound")
        ax.set_xlabel("generated tokens/s")
    elif kind == "latency":  # decode per iteration where measured, else the whole batch's latency
        decode = any(x.get("ms_per_iteration") for x in r["rows"])
        for key in sorted({(x["async_scheduling"] is True, x["input_len"]) for x in r["rows"]}):
            rows = [x for x in r["rows"] if (x["async_scheduling"] is True, x["input_len"]) == key]
            ax.plot([x["batch_size"] for x in rows],
                    [x["ms_per_iteration"] if decode else 1e3 * x["batch_latency_s"] for x in rows], "-o",
                    label=f"input {key[1]}" + (f", async {on_off(key[0])}" if decode else ""))
        if r["rows"][0].get("weight_bound_ms"):
            ax.axhline(r["rows"][0]["weight_bound_ms"], color="k", ls=":", label="weight-read bound")
        ax.set(xscale="log", xlabel="batch size", ylabel="ms per decode iteration" if decode else "batch latency (ms)")
    elif kind == "sweep":
        ok = [p for p in r["points"] if "error" not in p]
        for key in sorted({(p["scheduler"], p["max_num_seqs"]) for p in ok}):
            pts = sorted((p for p in ok if (p["scheduler"], p["max_num_seqs"]) == key), key=lambda p: p["rate"])
            ax.plot([p["requests_per_s"] for p in pts], [1e3 * p["median_norm_latency_s"] for p in pts],
                    "-o" if key[0] == "orca" else "--s", label=f"{key[0]} max_num_seqs={key[1]}")
        ax.set(yscale="log", xlabel="throughput (requests/s)", ylabel="median normalized latency (ms/token)")
    elif kind == "kernel":
        for context in sorted({x["context"] for x in r["decode"]}):
            rows = [x for x in r["decode"] if x["context"] == context and x.get("frac_of_copy")]
            ax.plot([x["batch_size"] for x in rows], [x["frac_of_copy"] for x in rows], "-o", label=f"context {context}")
        ax.set(xscale="log", xlabel="decode batch", ylabel="K/V read / copy bandwidth", ylim=(0, 1.05))
    else:  # serve: the last run's TTFT and TPOT distributions
        import numpy as np

        for key in ("ttft_s", "tpot_s"):
            ms = np.sort([1e3 * x[key] for x in r["requests"] if x.get(key) is not None])
            if ms.size:
                ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=key[:4].upper())
        ax.set(xscale="log", xlabel="ms", ylabel="fraction of requests")


def run(args: argparse.Namespace) -> None:
    print(write_report(args.results_dir, plots=not args.no_plots))

