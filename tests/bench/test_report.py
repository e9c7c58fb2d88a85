"""The plot carries labelled axes and real data; the table shows every section."""

from __future__ import annotations

from mmserve.bench.client import RequestOutput
from mmserve.bench.metrics import compute_metrics
from mmserve.bench.report import build_figure, format_table


def outputs() -> list[RequestOutput]:
    ok = [
        RequestOutput(idx=i, is_success=True, sent_at_s=0.1 * i, ttft_s=0.05 + 0.01 * i,
                      latency_s=0.5 + 0.01 * i, itl_s=[0.1] * 4,
                      chunk_at_s=[0.1 * i + 0.1 * k for k in range(5)], num_content_chunks=5,
                      output_tokens=5)
        for i in range(4)
    ]  # fmt: skip
    return [*ok, RequestOutput(idx=4, error_kind="timeout", error_message="t")]


def test_figure_has_labelled_axes_and_data() -> None:
    fig = build_figure(outputs(), duration_s=1.0)
    axes = fig.get_axes()
    assert len(axes) == 3
    for ax in axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        assert ax.get_lines() and all(len(line.get_xdata()) for line in ax.get_lines())
    assert axes[2].get_ylabel() == "output tokens / s"
    _, tok_per_s = axes[2].get_lines()[0].get_data()
    assert sum(tok_per_s) * (1.0 / 50) == 20  # 4 requests x 5 tokens, spread over the bins


def test_metrics_and_table() -> None:
    m = compute_metrics(outputs(), duration_s=2.0)
    assert (m.completed, m.failed, m.errors_by_kind) == (4, 1, {"timeout": 1})
    assert m.request_throughput == 2.0 and m.output_throughput == 10.0
    # TPOT = (latency - TTFT) / (output_tokens - 1) = 0.45 / 4 s for every request.
    assert abs(m.tpot.mean_ms - 112.5) < 1e-9
    assert m.itl.p99_ms == 100.0 and m.total_input_tokens is None
    table = format_table(m, {"available": False, "reason": "GET /metrics returned HTTP 404"})
    assert "errors: timeout" in table and "P99 TPOT (ms)" in table and "HTTP 404" in table
