"""A periodic one-line server status (load, throughput, hit rates, KV usage) when it changed."""

from __future__ import annotations

import asyncio
import logging
import time

from mmserve.metrics import EngineMetrics, MetricsSnapshot

logger = logging.getLogger("mmserve.status")

# (label, queries counter, hits counter) per cache tier, in the order a request meets them.
_TIERS = (
    ("processor", "processor_cache_queries", "processor_cache_hits"),
    ("encoder", "encoder_cache_queries", "encoder_cache_hits"),
    ("prefix", "prefix_cache_queries", "prefix_cache_hits"),
)


def format_status(prev: MetricsSnapshot, cur: MetricsSnapshot, elapsed_s: float) -> str | None:
    """The status line for the interval prev → cur, or None when nothing happened in it."""
    if prev.counters == cur.counters and prev.gauges == cur.gauges:
        return None
    c, p, g = cur.counters, prev.counters, cur.gauges
    dt = max(elapsed_s, 1e-9)
    prompt_tps = (c["prompt_tokens"] - p["prompt_tokens"]) / dt
    gen_tps = (c["generation_tokens"] - p["generation_tokens"]) / dt
    rates = []
    for label, queries, hits in _TIERS:
        num_queries = c[queries] - p[queries]
        hit_rate = f"{100.0 * (c[hits] - p[hits]) / num_queries:.1f}%" if num_queries else "-"
        rates.append(f"{label} {hit_rate}")
    return (
        f"running: {int(g['num_requests_running'])} reqs, "
        f"waiting: {int(g['num_requests_waiting'])} reqs, "
        f"prompt: {prompt_tps:.1f} tok/s, generation: {gen_tps:.1f} tok/s, "
        f"hit rates: {', '.join(rates)}, "
        f"KV blocks free: {int(g['kv_blocks_free'])}/{int(g['kv_blocks_total'])} "
        f"(usage {100.0 * cur.kv_cache_usage:.1f}%), "
        f"preemptions: {c['num_preemptions'] - p['num_preemptions']}, "
        f"encoder cache: {int(g['encoder_cache_used_slots'])}/"
        f"{int(g['encoder_cache_total_slots'])} slots"
    )


async def report_status(metrics: EngineMetrics, interval_s: float) -> None:
    """Log `format_status` every `interval_s` until cancelled."""
    prev = metrics.snapshot()
    prev_t = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        cur, now = metrics.snapshot(), time.monotonic()
        line = format_status(prev, cur, now - prev_t)
        if line is not None:
            logger.info("%s", line)
        prev, prev_t = cur, now
