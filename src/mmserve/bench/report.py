"""Renders a run as a text table, a JSON document and a PNG of latency CDFs and throughput."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmserve.bench.client import RequestOutput
from mmserve.bench.metrics import BenchmarkMetrics, LatencyStats, throughput_over_time

_WIDTH = 56


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label + ':':<40}{'n/a' if value is None else value:>16}"


def _header(title: str, fill: str = "-") -> str:
    return f" {title} ".center(_WIDTH, fill)


def format_table(metrics: BenchmarkMetrics, server: dict) -> str:
    m = metrics
    lines = [
        _header("Serving Benchmark Result", "="),
        _row("Requests (completed / total)", f"{m.completed} / {m.num_requests}"),
        _row("Failed requests", m.failed),
        *(_row(f"  errors: {kind}", n) for kind, n in m.errors_by_kind.items()),
        _row("Benchmark duration (s)", m.duration_s),
        _row("Total input tokens", m.total_input_tokens),
        _row("Total output tokens", m.total_output_tokens),
        _row("Request throughput (req/s)", m.request_throughput),
        _row("Output token throughput (tok/s)", m.output_throughput),
        _row("Total token throughput (tok/s)", m.total_token_throughput),
    ]
    for title, short, stats in (
        ("Time to First Token", "TTFT", m.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot),
        ("Inter-token Latency", "ITL", m.itl),
        ("End-to-end Latency", "E2EL", m.e2el),
    ):
        lines.append(_header(title))
        lines += _stat_rows(short, stats)
    lines.append(_header("Server caches over the run (from /metrics)"))
    if not server.get("available"):
        lines.append(f"unavailable: {server.get('reason')}")
    else:
        for tier, t in server["cache_tiers"].items():
            lines.append(_row(f"{tier} hit rate (hits/queries)".replace("_cache", ""), _hits(t)))
        for name in (
            "encoder_items_encoded",
            "encoder_forward_calls",
            "embedding_bytes_sent",
            "embedding_bytes_received",
        ):
            lines.append(_row(name.replace("_", " "), _n(server.get(name))))
        if server.get("replicas"):
            lines += _replica_rows(server)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _hits(tier: dict) -> str:
    rate = "n/a" if tier["hit_rate"] is None else f"{100 * tier['hit_rate']:.1f}%"
    return f"{rate} ({_n(tier['hits'])}/{_n(tier['queries'])})"


def _replica_rows(server: dict) -> list[str]:
    """A data-parallel server's caches and encodes per replica (the totals are above)."""
    lines = [_header("Per replica over the run (from /metrics)")]
    for replica, r in server["replicas"].items():
        for tier, t in r["cache_tiers"].items():
            name = tier.replace("_cache", "")
            lines.append(_row(f"replica {replica} {name} hit rate", _hits(t)))
        lines.append(_row(f"replica {replica} items encoded", _n(r["encoder_items_encoded"])))
    for reason, n in server["routed_requests"].items():
        lines.append(_row(f"requests routed by {reason}", _n(n)))
    return lines


def _n(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def _stat_rows(short: str, stats: LatencyStats | None) -> list[str]:
    if stats is None:
        return [_row(f"{short} (ms)", None)]
    return [
        _row(f"Mean {short} (ms)", stats.mean_ms),
        _row(f"P50 {short} (ms)", stats.p50_ms),
        _row(f"P90 {short} (ms)", stats.p90_ms),
        _row(f"P99 {short} (ms)", stats.p99_ms),
    ]


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def build_figure(outputs: list[RequestOutput], duration_s: float):
    """Three panels: CDFs of TTFT/E2E latency, CDFs of ITL/TPOT, output throughput over time."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    ok = [o for o in outputs if o.is_success]
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    ax_req, ax_tok, ax_tput = fig.subplots(1, 3)
    _cdf(ax_req, "TTFT", [o.ttft_s for o in ok if o.ttft_s is not None])
    _cdf(ax_req, "end-to-end", [o.latency_s for o in ok if o.latency_s is not None])
    ax_req.set_title("Request latency CDF")
    _cdf(ax_tok, "ITL", [g for o in ok for g in o.itl_s])
    _cdf(ax_tok, "TPOT", [t for o in ok if (t := o.tpot_s) is not None])
    ax_tok.set_title("Per-token latency CDF")
    centres_s, tok_per_s = throughput_over_time(outputs, duration_s)
    ax_tput.plot(centres_s, tok_per_s, drawstyle="steps-mid")
    ax_tput.set_xlabel("time since start (s)")
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_title("Output throughput over time")
    ax_tput.grid(alpha=0.3)
    return fig


def _cdf(ax, label: str, values_s: list[float]) -> None:
    ms = np.sort(np.asarray(values_s, dtype=np.float64)) * 1000.0  # [num_samples]
    if ms.size:
        ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, drawstyle="steps-post", label=label)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(loc="lower right")


def write_plot(outputs: list[RequestOutput], duration_s: float, path: str | Path) -> None:
    build_figure(outputs, duration_s).savefig(path, dpi=100)
