"""`python -m orca_jax.bench core-report DIR`: one table and one figure from DIR/*_core*.json.

Every number is read from the files `bench core` wrote; nothing is recomputed except ratios.
"""

from __future__ import annotations

import glob
import json
import os


def _load(results_dir: str) -> dict[str, dict]:
    runs = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*_core*.json"))):
        if path.endswith("_hf.json"):
            continue  # the transformers peer's own file; its numbers are inside the core JSON too
        with open(path) as f:
            runs[os.path.basename(path)[:-len(".json")]] = json.load(f)
    return runs


def rows(results_dir: str) -> list[dict]:
    """One row per results file: the issue's numbers where that run measured them."""
    out = []
    for name, run in _load(results_dir).items():
        row: dict = {"file": name, "model": run["setup"]["model"], "device": run["device"]}
        for label, starts in (("cold", 0), ("warm", 1)):
            runs = run.get("cold_start", {}).get("runs", [])
            if len(runs) > starts and "process_to_ready_s" in runs[starts]:
                row[f"start_{label}_s"] = runs[starts]["process_to_ready_s"]
                row["programs"] = runs[starts]["num_programs"]
        for mode in ("async_scheduling", "sync_scheduling"):
            section = run.get(mode)
            if not section:
                continue
            short = mode.split("_")[0]
            decode = {d["batch_size"]: d for d in section["decode"]}
            row[f"{short}_b1_ms"] = decode[1]["ms_per_iteration"]
            row[f"{short}_b32_ms"] = decode[32]["ms_per_iteration"]
            row["weight_bound_ms"] = decode[1]["weight_bound_ms"]
            for trace in ("uniform", "homogeneous"):
                row[f"{short}_{trace}_tok_s"] = section[trace]["runs"][-1]["tokens_per_s"]
                row[f"{short}_{trace}_of_bound"] = section[trace]["fraction_of_bound"]
                row[f"{trace}_bound_tok_s"] = section[trace]["bound_tokens_per_s"]
                row[f"{trace}_fed_over_real"] = section[trace]["fed_over_real"]
            row[f"{short}_idle_b32"] = section["idle"]["idle_fraction"]
            uniform = section["uniform"]["runs"][-1]
            if "host_split" in uniform:  # host ms per iteration: dispatching, and the rest of the host work
                per_iteration = 1e3 / max(uniform["iterations"], 1)
                row[f"{short}_dispatch_ms_per_it"] = uniform["host_split"]["dispatch_s"] * per_iteration
                row[f"{short}_host_other_ms_per_it"] = (uniform["host_s"] - uniform["host_split"]["dispatch_s"]) \
                    * per_iteration
            summary = (section.get("profile") or {}).get("summary")
            if summary and summary["device"]:  # the profiled window's busiest stream
                row[f"{short}_profile_busy"] = summary["device"][0]["busy_fraction"]
        http = run.get("http")
        if http and http.get("runs"):
            row["http_tok_s"] = http["runs"][-1]["output_throughput"]
            row["http_programs_at_ready"] = http["programs_at_ready"]
            row["http_programs_after"] = http["programs_after"]
            row["http_over_in_process"] = http.get("warm_over_in_process")
        hf = run.get("hf", {}).get("offline")
        if hf:
            row["hf_tok_s"] = hf["tokens_per_s"]
            if "async_uniform_tok_s" in row:
                row["ours_over_hf"] = row["async_uniform_tok_s"] / hf["tokens_per_s"]
        out.append(row)
    return out


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def markdown(table: list[dict]) -> str:
    keys = sorted({k for row in table for k in row} - {"file", "model", "device"})
    lines = ["| value | " + " | ".join(row["file"] for row in table) + " |",
             "| --- |" + " --- |" * len(table)]
    for key in keys:
        cells = []
        for row in table:
            value = row.get(key)
            cells.append(_cell(value))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bars = [(row["file"], label, row[key]) for row in table for key, label in (
        ("async_uniform_tok_s", "ours, overlap on"), ("sync_uniform_tok_s", "ours, overlap off"),
        ("http_tok_s", "ours through HTTP"), ("hf_tok_s", "transformers CB"),
        ("uniform_bound_tok_s", "roofline bound")) if key in row]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(bars) + 1.5))
    ax.barh([f"{name}: {label}" for name, label, _ in bars], [v for *_, v in bars], color="tab:blue")
    for i, (*_, value) in enumerate(bars):
        ax.text(value, i, f" {value:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens/s, ORCA uniform trace (512 requests at t=0)")
    ax.set_title(f"engine core on {table[0]['device']}" if table else "engine core")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(results_dir: str) -> None:
    table = rows(results_dir)
    with open(os.path.join(results_dir, "core.md"), "w") as f:
        f.write(markdown(table))
    plot(table, os.path.join(results_dir, "core.png"))
    print(markdown(table))
