"""What a level's results come to: vLLM's serving metrics, the roofline beside them, the
`vllm bench serve` table, a Markdown line per level and the plot."""

from __future__ import annotations

import numpy as np

from bench.load import SERVER_TIMERS, Result


# the suffix of a mode whose server ran with --no-enable-prefix-caching
NO_PREFIX_CACHE = ", no prefix cache"


def _stats(name: str, seconds: list[float], percentiles=(99,)) -> dict:
    """Mean, median, std and the given percentiles (always p99) in ms, as vLLM names them."""
    xs = np.asarray(seconds, dtype=float) * 1e3
    ps = sorted({99, *percentiles})
    keys = ["mean", "median", "std"] + [_p(p) for p in ps]
    if not len(xs):
        return {f"{k}_{name}_ms": float("nan") for k in keys}
    return {f"mean_{name}_ms": float(xs.mean()), f"median_{name}_ms": float(np.median(xs)),
            f"std_{name}_ms": float(xs.std()),
            **{f"{_p(p)}_{name}_ms": float(np.percentile(xs, p)) for p in ps}}


def _p(percentile: float) -> str:
    return f"p{percentile:g}"


def device_figures(server: dict, duration: float) -> dict:
    """Per role, from the device counters' increase over the level: the share of the
    level's wall time its devices spent on steps (summed over the role's workers, so up
    to their count) and the mean device time of a step. A role far below 100 % with
    work queued is held back by its host."""
    out = {}
    for key, busy in server.items():
        if key.startswith("qwen35:device_busy_seconds_total{"):
            role = key[key.index("{") + 1:-1]
            steps = server.get(f"qwen35:device_steps_total{{{role}}}", 0.0)
            if steps:
                out[role] = {"busy_share": busy / duration, "steps": steps,
                             "step_ms": 1e3 * busy / steps}
    return out


def _per(total: float, count: float) -> float:
    """A mean from a counter pair: NaN where nothing was counted."""
    return total / count if count else float("nan")


def server_times(server: dict) -> dict:
    """The server's own means over the level (ms): time to first token from the HTTP
    handler's start (the body parsed), of which waiting in the engine's queue
    (vllm:request_queue_time) and the rest (the steps up to the first token and the
    hand-offs between handler and engine). Beside the client's TTFT it splits what the
    server spends from what the HTTP path and the client add; NaN where the server keeps
    no such timer."""
    return {f"server_mean_{key}_ms": 1e3 * _per(server.get(f"{name}_sum", 0.0),
                                                 server.get(f"{name}_count", 0.0))
            for key, name in zip(("ttft", "queue", "rest"), SERVER_TIMERS, strict=True)}


def summarise(results: list[Result], duration: float, concurrency: int, num_gpus: int,
              server: dict, percentiles=(99,)) -> dict:
    """vLLM's `calculate_metrics` over the successful requests (with `percentiles`, its
    `--metric-percentiles`), plus throughput per GPU and the server's figures (peak KV
    and state bytes in use, transfers)."""
    ok = [r for r in results if r.ok]
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    transfers = server.get("vllm:nixl_xfer_time_seconds_count", 0.0)
    queries = server.get("vllm:prefix_cache_queries_total", 0.0)
    return {
        "prefix_cache_hit_rate": (server.get("vllm:prefix_cache_hits_total", 0.0) / queries
                                  if queries else 0.0),
        "peak_kv_bytes": server.get("qwen35:kv_cache_bytes_in_use", 0.0),
        "peak_state_bytes": server.get("qwen35:state_bytes_in_use", 0.0),
        "transfers": transfers,
        "mean_transfer_ms": 1e3 * _per(server.get("vllm:nixl_xfer_time_seconds_sum", 0.0),
                                       transfers),
        "mean_transfer_ack_ms": 1e3 * _per(
            server.get("qwen35:kv_transfer_ack_seconds_total", 0.0), transfers),
        "device": device_figures(server, duration),
        **server_times(server),
        "mean_transfer_bytes": _per(server.get("vllm:nixl_bytes_transferred_sum", 0.0),
                                    transfers),
        "max_concurrency": concurrency, "num_gpus": num_gpus, "duration": duration,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": tin, "total_output_tokens": tout,
        "request_throughput": len(ok) / duration, "output_throughput": tout / duration,
        "total_token_throughput": (tin + tout) / duration,
        "total_token_throughput_per_gpu": (tin + tout) / duration / num_gpus,
        "metric_percentiles": sorted({99, *percentiles}),
        **_stats("ttft", [r.ttft for r in ok], percentiles),
        **_stats("tpot", [(r.latency - r.ttft) / (r.output_tokens - 1)
                          for r in ok if r.output_tokens > 1], percentiles),
        **_stats("itl", [x for r in ok for x in r.itl], percentiles),
        **_stats("e2el", [r.latency for r in ok], percentiles),
        "texts": [r.text if r.ok else None for r in results],
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "chunks": [len(r.itl) + 1 if r.ok else 0 for r in results],  # streamed with choices
        "ttfts": [r.ttft for r in results],
    }


def table(s: dict, metrics=("ttft", "tpot", "itl")) -> str:
    """The result block of `vllm bench serve` for `metrics` (its `--percentile-metrics`),
    with the mode and per-GPU throughput added."""
    line = "{:<40} {:<10}".format
    out = ["{:=^50}".format(" Serving Benchmark Result "),
           line("Mode:", s["mode"]),
           line("Successful requests:", s["completed"]),
           line("Failed requests:", s["failed"]),
           line("Maximum request concurrency:", s["max_concurrency"]),
           line("Benchmark duration (s):", f"{s['duration']:.2f}"),
           line("Total input tokens:", s["total_input_tokens"]),
           line("Total generated tokens:", s["total_output_tokens"]),
           line("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
           line("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
           line("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
           line("Total token throughput per GPU (tok/s):",
                f"{s['total_token_throughput_per_gpu']:.2f}")]
    out += [line("Peak KV + state in use (GiB):",
                 f"{s['peak_kv_bytes'] / 2**30:.2f} + {s['peak_state_bytes'] / 2**30:.2f}")]
    out += [line("Prefix cache hit rate (tokens):", f"{s['prefix_cache_hit_rate']:.1%}")]
    if s["transfers"]:
        out += [line("Transfers (mean ms, of which to ack, MiB):",
                     f"{s['transfers']:.0f} ({s['mean_transfer_ms']:.1f}, "
                     f"{s['mean_transfer_ack_ms']:.1f}, {s['mean_transfer_bytes'] / 2**20:.1f})")]
    out += [line("Server mean TTFT = queue + rest (ms):",
                 f"{s['server_mean_ttft_ms']:.0f} = {s['server_mean_queue_ms']:.0f} + "
                 f"{s['server_mean_rest_ms']:.0f}")]
    for role, d in s["device"].items():
        out += [line(f"{role.capitalize()} device busy (step ms):",
                     f"{d['busy_share']:.0%} ({d['step_ms']:.1f})")]
    if "roofline_tokens_per_s_per_gpu" in s:
        out += [line("Roofline tok/s per GPU (share):",
                     f"{s['roofline_tokens_per_s_per_gpu']:.0f} ({s['roofline_share']:.0%})"),
                line("Prefill floor tok/s per GPU:", f"{s['prefill_floor_tokens_per_s']:.0f}"),
                line("Decode step floor ms (of median TPOT):",
                     f"{s['decode_step_floor_ms']:.1f} ({s['decode_floor_share']:.0%})")]
    for title, key, short in (("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                              ("Inter-token Latency", "itl", "ITL"),
                              ("End-to-end Latency", "e2el", "E2EL")):
        if key not in metrics:
            continue
        out.append("{:-^50}".format(title))
        stats = [("mean", "Mean"), ("median", "Median")] + [
            (_p(p), _p(p).upper()) for p in s.get("metric_percentiles", [99])]
        for stat, label in stats:
            out.append(line(f"{label} {short} (ms):", f"{s[f'{stat}_{key}_ms']:.2f}"))
    out += [f"errors: {e}" for e in s["errors"]]
    return "\n".join(out + ["=" * 50])


def summary(rows: list[dict]) -> str:
    """One line per run: the sweep at a glance (Markdown)."""
    head = ("| mode | C | ok/all | duration s | req/s | out tok/s | total tok/s | tok/s/GPU "
            "| prefix hits | TTFT med/p99 ms | TPOT med/p99 ms | ITL med/p99 ms | peak KV+state GiB "
            "| transfer ms/req (to ack) | device busy (step ms) | roofline tok/s/GPU (share) "
            "| decode floor ms (of TPOT) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        out.append(
            f"| {s['mode']} | {s['max_concurrency']} | {s['completed']}/"
            f"{s['completed'] + s['failed']} | {s['duration']:.1f} | "
            f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
            f"{s['total_token_throughput']:.1f} | {s['total_token_throughput_per_gpu']:.1f} | "
            f"{s['prefix_cache_hit_rate']:.0%} | "
            f"{s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
            f"{s['median_tpot_ms']:.1f} / {s['p99_tpot_ms']:.1f} | "
            f"{s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} | "
            f"{(s['peak_kv_bytes'] + s['peak_state_bytes']) / 2**30:.2f} | "
            f"{s['mean_transfer_ms']:.1f} ({s['mean_transfer_ack_ms']:.1f}) | "
            + (", ".join(f"{r} {d['busy_share']:.0%} ({d['step_ms']:.1f})"
                         for r, d in s["device"].items()) or "-") + " | " + (
                f"{s['roofline_tokens_per_s_per_gpu']:.0f} ({s['roofline_share']:.0%}) | "
                f"{s['decode_step_floor_ms']:.1f} ({s['decode_floor_share']:.0%}) |"
                if "roofline_share" in s else "- | - |"))
    return "\n".join(out)


def roofline_figures(mode: str, s: dict, results: list[Result], roof: tuple) -> dict:
    """The level's floor (bench.roofline.serving_floor) beside what it reached: total
    tokens/s per GPU, and the decode step floor against the median TPOT.  The
    disaggregated floor is that of one prefill and one decode device."""
    from bench.roofline import serving_floor

    costs, ceilings = roof
    ok = [r for r in results if r.ok]
    if not ok:
        return {}
    f = serving_floor(costs, ceilings, [r.prompt_tokens for r in ok],
                      [r.output_tokens for r in ok], s["max_concurrency"])
    per_gpu = (f["disaggregated_tokens_per_s_per_gpu"] if mode.startswith("disaggregated")
               else f["aggregated_tokens_per_s"])
    return {"roofline_tokens_per_s_per_gpu": per_gpu,
            "roofline_share": s["total_token_throughput_per_gpu"] / per_gpu,
            "prefill_floor_tokens_per_s": f["prefill_tokens_per_s"],
            "decode_step_floor_ms": 1e3 * f["decode_step_s"],
            "decode_step_floor_bytes": f["decode_step_bytes"],
            "decode_floor_share": (1e3 * f["decode_step_s"] / s["median_tpot_ms"]
                                   if s["median_tpot_ms"] > 0 else float("nan"))}


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Four panels against concurrency: total tokens/s per GPU, TTFT and TPOT (median and
    p99); and the curve disaggregation is judged by, tokens/s per GPU against each user's
    tokens/s (1 / median TPOT), one point per level. Every y axis starts at 0. `title`:
    the model, lengths and device."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(11, 8))
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        rs = [r for r in rows if r["mode"] == mode]
        x, color = [r["max_concurrency"] for r in rs], f"C{i}"
        per_gpu = [r["total_token_throughput_per_gpu"] for r in rs]
        a.plot(x, per_gpu, "o-", color=color, label=mode)
        for ax, key in ((b, "ttft"), (c, "tpot")):
            ax.plot(x, [r[f"median_{key}_ms"] for r in rs], "o-", color=color,
                    label=f"{mode} median")
            ax.plot(x, [r[f"p99_{key}_ms"] for r in rs], "x--", color=color, label=f"{mode} p99")
        per_user = [1e3 / r["median_tpot_ms"] if r["median_tpot_ms"] > 0 else float("nan")
                    for r in rs]
        d.plot(per_user, per_gpu, "o-", color=color, label=mode)
        for u, g, n in zip(per_user, per_gpu, x):
            d.annotate(f"C={n}", (u, g), textcoords="offset points", xytext=(4, 4), fontsize=7)
    a.set(xlabel="concurrency", ylabel="total tokens/s per GPU", title="Throughput")
    b.set(xlabel="concurrency", ylabel="TTFT (ms)", title="Time to first token")
    c.set(xlabel="concurrency", ylabel="TPOT (ms)", title="Time per output token")
    d.set(xlabel="output tokens/s per user (1 / median TPOT)",
          ylabel="total tokens/s per GPU", title="Throughput against interactivity")
    levels = sorted({r["max_concurrency"] for r in rows})
    for ax in (a, b, c):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()
    for ax in (a, b, c, d):
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    d.set_xlim(left=0)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def greedy_agreement(rows: list[dict]) -> list[dict]:
    """Per concurrency level, each mode against the reference mode (the aggregated
    server without prefix caching if it ran, else the aggregated server, else the first
    mode): how many requests (same prompts, greedy) produced the same completion text in
    both, and where the first differing one diverged. Under bf16 a batch of another
    composition may legitimately flip a near-tie, so this is a figure to read, not a
    pass/fail."""
    by = {(r["mode"], r["max_concurrency"]): r for r in rows}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    ref = next((m for m in (f"aggregated{NO_PREFIX_CACHE}", "aggregated") if m in modes),
               modes[0] if modes else None)
    out = []
    for (mode, c), d in by.items():
        a = by.get((ref, c))
        if mode == ref or a is None:
            continue
        both = [(i, x, y) for i, (x, y) in enumerate(zip(d["texts"], a["texts"]))
                if x is not None and y is not None]
        differ = [(i, x, y) for i, x, y in both if x != y]
        first = None
        if differ:
            i, x, y = differ[0]
            n = min(len(x), len(y))
            first = {"request": i, "char": next((j for j in range(n) if x[j] != y[j]), n)}
        out.append({"mode": mode, "against": ref, "max_concurrency": c, "compared": len(both),
                    "same": len(both) - len(differ), "first_difference": first})
    return out
