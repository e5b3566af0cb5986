"""Plots (matplotlib PNG) and summary.md from one results directory of suite JSON files."""

from __future__ import annotations

import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _merge(base: dict, extra: dict) -> None:
    """Fold a tagged run's e2e points into its model's results and redo the matched-latency table."""
    from orca_jax.bench.e2e import compare_at_matched_latency
    points = (extra.get("e2e") or {}).get("points", [])
    if not points:
        return
    e2e = base.setdefault("e2e", {"points": []})
    e2e["points"] = e2e.get("points", []) + [p | {"run": extra.get("command")} for p in points]
    e2e["matched_latency"] = compare_at_matched_latency(e2e["points"])
    base.setdefault("merged_runs", []).append(extra.get("command"))


def _load(results_dir: str) -> tuple[dict[str, dict], dict | None]:
    models, extensions = {}, []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        name = os.path.basename(path)[:-5]
        if name.endswith("_hf") or name in ("padding", "engine_issue"):
            continue
        with open(path) as f:
            data = json.load(f)
        if data.get("extends"):
            extensions.append(data)
        elif "model" in data and "profile" in data:
            hf_path = os.path.join(results_dir, f"{name}_hf.json")
            if not (data.get("hf") or {}).get("offline") and os.path.exists(hf_path):
                data["hf"] = json.load(open(hf_path))
            models[name] = data
    for extra in extensions:
        if extra["extends"] in models:
            _merge(models[extra["extends"]], extra)
    cpu = os.path.join(results_dir, "engine_issue.json")
    return models, (json.load(open(cpu)) if os.path.exists(cpu) else None)


def _ok(section) -> bool:
    return isinstance(section, dict) and "error" not in section and "skipped" not in section


def plot_e2e(name: str, data: dict, out_dir: str) -> str | None:
    points = [p for p in (data.get("e2e") or {}).get("points", []) if "error" not in p]
    if not points:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(p["policy"], p["max_num_seqs"]) for p in points}):
        pts = sorted((p for p in points if (p["policy"], p["max_num_seqs"]) == key), key=lambda p: p["rate"])
        style = "-o" if key[0] == "orca" else "--s"
        label = f"{'ORCA (ours)' if key[0] == 'orca' else 'request-level baseline'} max_bs={key[1]}"
        x = [p["throughput_req_s"] for p in pts]
        axes[0].plot(x, [1e3 * p["median_norm_latency_s"] for p in pts], style, label=label)
        axes[1].plot(x, [1e3 * p["ttft_s"]["p50"] for p in pts], style, label=label)
    axes[0].set_ylabel("median normalized latency (ms/token)")
    axes[1].set_ylabel("median time to first token (ms)")
    for ax in axes:
        ax.set_xlabel("throughput (requests/s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{name}: latency vs throughput ({_device(data)})")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}_e2e.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_micro(name: str, data: dict, out_dir: str) -> str | None:
    rows = (data.get("microbench") or {}).get("rows", [])
    hf_rows = (data.get("hf") or {}).get("microbench", [])
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for input_len in sorted({r["input_len"] for r in rows}):
        mine = [r for r in rows if r["input_len"] == input_len]
        ax.plot([r["batch_size"] for r in mine], [1e3 * r["batch_seconds"] for r in mine], "-o",
                label=f"ours, input {input_len}")
        ax.plot([r["batch_size"] for r in mine], [1e3 * r["roofline"]["bound_s"] for r in mine], ":",
                color=ax.lines[-1].get_color(), label=f"roofline bound, input {input_len}")
        theirs = [r for r in hf_rows if r["input_len"] == input_len]
        if theirs:
            ax.plot([r["batch_size"] for r in theirs], [1e3 * r["batch_seconds"] for r in theirs], "--s",
                    label=f"transformers CB, input {input_len}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (identical requests, 32 generated tokens)")
    ax.set_ylabel("time per batch (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{name}: engine microbenchmark ({_device(data)})", fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}_microbench.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _offline_rows(data: dict) -> list[tuple[str, float]]:
    rows = [(f"{'ours' if r['policy'] == 'orca' else 'baseline'} bs={r['max_num_seqs']}", r["throughput_tok_s"])
            for r in (data.get("offline") or {}).get("runs", []) if "throughput_tok_s" in r]
    hf = (data.get("hf") or {}).get("offline")
    if hf:
        rows.append(("transformers CB", hf["tokens_per_s"]))
    return rows


def plot_offline(models: dict[str, dict], out_dir: str) -> str | None:
    names = [n for n in models if _offline_rows(models[n])]
    if not names:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = _offline_rows(models[name])
        colors = ["tab:blue" if r[0].startswith("ours") else "tab:gray" if r[0].startswith("base") else "tab:orange"
                  for r in rows]
        ax.bar(range(len(rows)), [r[1] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("generated tokens/s")
        n = ((models[name].get("offline") or {}).get("trace") or {}).get("num_requests", "?")
        ax.set_title(f"{name} ({n} requests)", fontsize=10)
    fig.suptitle("offline throughput, all requests at time 0")
    fig.tight_layout()
    path = os.path.join(out_dir, "offline_throughput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_padding(models: dict[str, dict], out_dir: str) -> str | None:
    report = next((m["padding"] for m in models.values() if _ok(m.get("padding"))), None)
    if report is None:
        return None
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    width = 0.27
    xs = range(len(rows))
    for k, (key, label) in enumerate((("naive_waste", "request-level, arrival order"),
                                      ("sorted_waste", "request-level, length-sorted"),
                                      ("ragged_bucket_waste", "ragged (ours): bucket rounding"))):
        ax.bar([x + (k - 1) * width for x in xs], [100 * r[key] for r in rows], width, label=label)
    ax.set_xticks(list(xs), [str(r["batch_size"]) for r in rows])
    ax.set_xlabel("batch size")
    ax.set_ylabel("padded / real tokens fed (%)")
    ax.legend(fontsize=8)
    ax.set_title("padding waste on the paper's trace (512 requests)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, "padding_waste.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _host_only(summary: dict) -> float:
    """Host seconds per iteration outside runner.execute (which can block on the device)."""
    return summary["host_s_per_iter"] - summary["host_breakdown_s_per_iter"]["dispatch"]


def _split(summary: dict) -> str:
    b = summary["host_breakdown_s_per_iter"]
    return (f"host {_ms(_host_only(summary))} ms (schedule {_ms(b['schedule'])}, build_batch {_ms(b['build_batch'])}, "
            f"update {_ms(b['update'])}, rest is output handling) vs execute {_ms(b['dispatch'])} ms + wait "
            f"{_ms(summary['device_wait_s_per_iter'])} ms")


def _device(data: dict) -> str:
    return (data.get("device") or {}).get("kind", "?")


def _ms(x: float) -> str:
    return f"{1e3 * x:.2f}"


def _model_md(name: str, data: dict) -> list[str]:
    s = data["shapes"]
    eng = data.get("engine") or {}
    lines = [f"## {name}", "",
             f"- shapes: {s['family']}, {s['num_layers']} layers, hidden {s['hidden_size']}, ffn {s['ffn_size']}, "
             f"{s['num_heads']} heads / {s['num_kv_heads']} KV heads x {s['head_dim']}, vocab {s['vocab_size']}, "
             f"{s['num_params'] / 1e9:.2f} B params, random weights, bf16",
             f"- device: {_device(data)} (jax {(data.get('device') or {}).get('jax')}); attention: {eng.get('attention')}; "
             f"token budget {eng.get('token_budget')}, KV pages {eng.get('kv_pages')} x 16 tokens, "
             f"{(eng.get('precompile') or {}).get('num_forward_programs')} forward programs precompiled in "
             f"{(eng.get('precompile') or {}).get('compile_s', float('nan')):.0f} s",
             f"- command: `{data.get('command')}` (profile {data.get('profile')}, seed {data.get('seed')})"]
    for command in data.get("merged_runs", []):
        lines.append(f"- e2e points also from: `{command}`")
    peaks = data.get("peaks")
    if _ok(peaks):
        lines.append(f"- measured peaks: {peaks['hbm_GB_s']:.0f} GB/s copy bandwidth (read+write), "
                     f"{peaks['matmul_TFLOP_s']:.0f} TFLOP/s bf16 matmul")
    for key in ("attention_check", "engine_check"):
        if data.get(key):
            lines.append(f"- {key}: `{json.dumps({k: v for k, v in data[key].items() if k != 'section_s'})}`")
    lines += ["", "### Offline throughput (all requests at time 0)", "",
              "Per iteration: host = scheduling + batch building + update + output handling; execute = the "
              "runner's dispatch call, which blocks until the device is done for large buckets (see the dispatch "
              "check), so it is mostly device time there; wait = blocked on the sampled tokens.", "",
              "| engine | max bs | tokens/s | req/s | iterations | mean batch | host ms/it | execute ms/it | "
              "wait ms/it | padded tokens fed / real | roofline bound / measured |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (data.get("offline") or {}).get("runs", []):
        if "throughput_tok_s" in r:
            lines.append(f"| {'ours (ORCA)' if r['policy'] == 'orca' else 'request-level baseline'} | "
                         f"{r['max_num_seqs']} | {r['throughput_tok_s']:.0f} | {r['throughput_req_s']:.2f} | "
                         f"{r['iterations']} | {r['mean_batch_size']:.1f} | {_ms(_host_only(r))} | "
                         f"{_ms(r['host_breakdown_s_per_iter']['dispatch'])} | {_ms(r['device_wait_s_per_iter'])} | "
                         f"{r['padded_tokens_fed'] / r['tokens_fed']:.2f} | {r['roofline']['achieved_fraction']:.2f} |")
    hf = data.get("hf") or {}
    if hf.get("offline"):
        o = hf["offline"]
        lines.append(f"| transformers {hf.get('transformers')} continuous batching ({str(hf.get('attn_implementation')).replace('|', '&#124;')}) "
                     f"| default | {o['tokens_per_s']:.0f} | {o['requests_per_s']:.2f} | | | | | |")
    elif hf:
        lines.append(f"| transformers continuous batching | failed: {str(hf.get('log_tail', ''))[-300:]!r} |")
    issue = data.get("engine_issue") or {}
    if "speedup_tokens_per_s" in issue:
        m, a = issue["mixed"], issue["one_at_a_time"]
        lines += ["", "### Engine issue: batched vs one at a time", "",
                  f"{m['num_requests']} mixed requests batched: {m['throughput_tok_s']:.0f} tokens/s (mean batch "
                  f"{m['mean_batch_size']:.1f}); {a['num_requests']} of them one at a time: "
                  f"{a['throughput_tok_s']:.0f} tokens/s; x{issue['speedup_tokens_per_s']:.1f}. Per iteration, "
                  f"batched: {_split(m)}; alone: {_split(a)}."]
    e2e = data.get("e2e") or {}
    if e2e.get("points"):
        lines += ["", "### End to end (real-time Poisson arrivals)", "",
                  f"Rates swept: {e2e.get('rates')} req/s (fractions of ours' offline capacity "
                  f"{e2e.get('capacity_req_s', 0):.1f} req/s).", "",
                  "| engine | max bs | rate | req/s done | median norm. latency ms/tok | p90 | TTFT p50/p99 ms | "
                  "TPOT p50/p99 ms | roofline |", "|---|---|---|---|---|---|---|---|---|"]
        for p in e2e["points"]:
            if "error" in p:
                lines.append(f"| {p['policy']} | {p['max_num_seqs']} | {p['rate']} | {p['error']} |")
                continue
            lines.append(f"| {p['policy']} | {p['max_num_seqs']} | {p['rate']:.1f} | {p['throughput_req_s']:.2f} | "
                         f"{_ms(p['median_norm_latency_s'])} | {_ms(p['norm_latency_s']['p90'])} | "
                         f"{_ms(p['ttft_s']['p50'])}/{_ms(p['ttft_s']['p99'])} | "
                         f"{_ms(p['tpot_s']['p50'])}/{_ms(p['tpot_s']['p99'])} | "
                         f"{p['roofline']['achieved_fraction']:.2f} |")
        if e2e.get("matched_latency"):
            lines += ["", "Throughput at matched median normalized latency (best max batch size of each):", "",
                      "| latency target ms/token | ours req/s (bs) | baseline req/s (bs) | ratio |", "|---|---|---|---|"]
            for r in e2e["matched_latency"]:
                ratio = r["ratio"]
                lines.append(f"| {_ms(r['latency_target_s_per_token'])} | {r['orca_req_s']:.2f} ({r['orca_best_bs']}) "
                             f"| {r['baseline_req_s']:.2f} ({r['baseline_best_bs']}) | "
                             f"{'n/a' if ratio is None else f'{ratio:.2f}'} |")
    micro = (data.get("microbench") or {}).get("rows", [])
    if micro:
        hf_micro = {(r["input_len"], r["batch_size"]): r["batch_seconds"] for r in hf.get("microbench", [])}
        lines += ["", "### Engine microbenchmark (identical requests, 32 generated tokens)", "",
                  "| input | batch | ours ms | transformers CB ms | roofline bound ms | bound / measured |",
                  "|---|---|---|---|---|---|"]
        for r in micro:
            theirs = hf_micro.get((r["input_len"], r["batch_size"]))
            lines.append(f"| {r['input_len']} | {r['batch_size']} | {_ms(r['batch_seconds'])} | "
                         f"{'' if theirs is None else _ms(theirs)} | {_ms(r['roofline']['bound_s'])} | "
                         f"{r['roofline']['achieved_fraction']:.2f} |")
    rows = (data.get("dispatch_check") or {}).get("rows", [])
    if rows:
        lines += ["", "### Dispatch check (all-padding batches; ms)", "",
                  "| bucket (T, S, P) | execute() returns | result ready | forward alone returns / ready | "
                  "sampling dispatched behind the forward | argmax dispatched behind the forward |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {tuple(r['bucket'])} | {r['dispatch_ms']:.2f} | {r['total_ms']:.2f} | "
                         f"{r.get('forward_dispatch_ms', float('nan')):.2f} / {r.get('forward_total_ms', float('nan')):.2f} | "
                         f"{r.get('sample_dispatch_behind_forward_ms', float('nan')):.2f} | "
                         f"{r.get('argmax_dispatch_behind_forward_ms', float('nan')):.2f} |")
    skipped = [k for k, v in data.items() if isinstance(v, dict) and ("skipped" in v or "error" in v)]
    if skipped:
        lines += ["", "Not completed: " + "; ".join(
            f"{k}: {data[k].get('skipped') or data[k].get('error')}" for k in skipped)]
    return lines + [""]


def _padding_md(models: dict[str, dict]) -> list[str]:
    report = next((m["padding"] for m in models.values() if _ok(m.get("padding"))), None)
    if report is None:
        return []
    lines = [f"## Padding waste (host arithmetic on the {report['trace']['num_requests']}-request offline trace)", "",
             f"Real tokens fed: {report['real_tokens']}; token budget {report['token_budget']}.", "",
             "| batch size | request-level, arrival order | request-level, length-sorted | ragged (ours), bucket rounding |",
             "|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['batch_size']} | {100 * r['naive_waste']:.1f}% | {100 * r['sorted_waste']:.1f}% | "
                     f"{100 * r['ragged_bucket_waste']:.1f}% |")
    return lines + [""]


def _cpu_md(cpu: dict) -> list[str]:
    m, a = cpu["mixed"], cpu["one_at_a_time"]
    return ["## Engine issue on CPU", "",
            f"- model: {cpu['model']}, {cpu['weights']}, {cpu['dtype']}; device: CPU, {cpu['device']['cores']} cores, "
            f"jax {cpu['device']['jax']}; command: `{cpu['command']}`",
            f"- trace: {cpu['trace']['num_requests']} requests, prompt {cpu['trace']['prompt_len']}, "
            f"{cpu['trace']['max_tokens']['max']} generated tokens each, all at time 0",
            f"- batched: {m['throughput_tok_s']:.1f} tokens/s, mean batch {m['mean_batch_size']:.1f}; per iteration "
            f"{_split(m)}",
            f"- one at a time ({cpu['one_at_a_time_subset']} of them): {a['throughput_tok_s']:.1f} tokens/s; per "
            f"iteration {_split(a)}",
            f"- speedup: x{cpu['speedup_tokens_per_s']:.1f}", ""]


def _diag_md(results_dir: str) -> list[str]:
    """The scan-vs-unrolled weight-read check (orca_jax/bench/diag.py), one row per run."""
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "diag_scan*.json"))):
        with open(path) as f:
            data = json.load(f)
        for r in data["rows"]:
            rows.append(f"| `{data['xla_flags'] or '(none)'}` | {r['tokens']} | {r['scan_ms']:.2f} ({r['scan_GB_s']:.0f} GB/s) | "
                        f"{r['unrolled_ms']:.2f} ({r['unrolled_GB_s']:.0f} GB/s) |")
    if not rows:
        return []
    return ["## Diagnostic: layer weights through lax.scan vs an unrolled loop", "",
            "32 layers of x @ W_up @ W_down (4096 x 14336 each, bf16, 7.5 GB of weights), x of T tokens; GB/s = weight "
            "bytes / time. Command: `python3 -m orca_jax.bench.diag` (and with the XLA_FLAGS shown).", "",
            "| XLA_FLAGS | T | scan over stacked weights ms | unrolled loop ms |", "|---|---|---|---|"] + rows + [""]


def write_report(results_dir: str) -> str:
    """Write the PNGs and summary.md into results_dir; returns the summary's path."""
    models, cpu = _load(results_dir)
    plots = [plot_offline(models, results_dir), plot_padding(models, results_dir)]
    for name, data in models.items():
        plots += [plot_e2e(name, data, results_dir), plot_micro(name, data, results_dir)]
    lines = [f"# orca_jax benchmarks: {os.path.basename(os.path.abspath(results_dir))}", ""]
    if models:
        lines += ["Reproduces ORCA (OSDI '22) section 6 on one GPU: traces with Poisson arrivals, prompt U(32, 512), "
                  "max_gen U(1, 128), EOS ignored; random weights; the request-level baseline runs on our own model "
                  "code (see orca_jax/bench/baseline.py).", ""]
    lines += ["Regenerate with `python -m orca_jax.bench report <this dir>`.", ""]
    notes = os.path.join(results_dir, "notes.md")
    if os.path.exists(notes):  # hand-written findings, kept across regenerations
        with open(notes) as f:
            lines += [f.read().rstrip(), ""]
    lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots if p]
    lines.append("")
    for name, data in models.items():
        lines += _model_md(name, data)
    lines += _padding_md(models)
    lines += _diag_md(results_dir)
    if cpu:
        lines += _cpu_md(cpu)
    path = os.path.join(results_dir, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path
