"""Scrapes a Prometheus /metrics endpoint before and after a run and diffs mmserve's counters.

A data-parallel server exports each engine-core counter per replica (label `replica`) beside
its total (the series without the label): the totals are read as from any server, and each
replica's encoder and prefix caches and encodes are diffed too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Cache tiers as (report name, counter prefix); each has <prefix>_queries_total and _hits_total.
CACHE_TIERS = (
    ("processor_cache", "mmserve_processor_cache"),
    ("encoder_cache", "mmserve_encoder_cache"),
    ("prefix_cache", "mmserve_prefix_cache"),  # counted in tokens, not requests
)
COUNTERS = (
    ("encoder_items_encoded", "mmserve_encoder_items_encoded"),
    ("encoder_forward_calls", "mmserve_encoder_forward_calls"),
    # a disaggregated server's two directions: item bytes to its encoders, embeddings back
    ("embedding_bytes_sent", 'mmserve_embedding_transfer_bytes{direction="sent"}'),
    ("embedding_bytes_received", 'mmserve_embedding_transfer_bytes{direction="received"}'),
)
# What is reported per replica of a data-parallel server (the engine core's caches and work).
REPLICA_TIERS = ("encoder_cache", "prefix_cache")
REPLICA_COUNTERS = ("encoder_items_encoded",)
ROUTED = "mmserve_dp_routed_requests"  # by reason: affinity or load
ROUTED_REASONS = ("affinity", "load")


@dataclass(frozen=True)
class MetricsSnapshot:
    """Every sample of one scrape, summed over label sets (e.g. one series per model), and by
    its labels other than model_name too (`name{direction="sent"}`). A sample with a `replica`
    label counts only under its labels (`name{replica="0"}`), never in the total."""

    samples: dict[str, float]
    replicas: tuple[str, ...] = ()  # the `replica` label values seen, in numeric order

    def counter(self, name: str) -> float | None:
        # The parser strips `_total` from counter family names but keeps it on samples, and an
        # untyped exposition keeps whatever the server wrote: accept both spellings.
        name, brace, labels = name.partition("{")
        base = name.removesuffix("_total")
        for candidate in (base + "_total" + brace + labels, base + brace + labels):
            if candidate in self.samples:
                return self.samples[candidate]
        return None

    def has_mmserve_counters(self) -> bool:
        names = [p + s for _, p in CACHE_TIERS for s in ("_queries", "_hits")]
        names += [p for _, p in COUNTERS]
        return any(self.counter(n) is not None for n in names)


@dataclass(frozen=True)
class ScrapeResult:
    snapshot: MetricsSnapshot | None
    reason: str | None = None  # why there is no snapshot


def parse_metrics(text: str) -> MetricsSnapshot:
    """Raises ValueError when `text` is not the Prometheus text format."""
    samples: dict[str, float] = {}
    replicas: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # creation timestamps, not counts
            value = float(sample.value)
            replica = sample.labels.get("replica")
            if replica is None:
                samples[sample.name] = samples.get(sample.name, 0.0) + value
            else:  # summed over its other labels too, as the total is
                replicas.add(replica)
                key = f'{sample.name}{{replica="{replica}"}}'
                samples[key] = samples.get(key, 0.0) + value
            labels = sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
            if labels and labels != [("replica", replica)]:
                key = sample.name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"
                samples[key] = samples.get(key, 0.0) + value
    order = sorted(replicas, key=lambda r: (not r.isdigit(), int(r) if r.isdigit() else 0, r))
    return MetricsSnapshot(samples, tuple(order))


async def scrape(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> ScrapeResult:
    try:
        resp = await client.get(url, headers=headers)
    except httpx.HTTPError as e:
        return ScrapeResult(None, f"GET {url} failed: {type(e).__name__}")
    if resp.status_code != 200:
        return ScrapeResult(None, f"GET {url} returned HTTP {resp.status_code}")
    try:
        snapshot = parse_metrics(resp.text)
    except ValueError:
        return ScrapeResult(None, f"GET {url} did not return the Prometheus text format")
    if not snapshot.has_mmserve_counters():
        return ScrapeResult(None, f"{url} exposes none of mmserve's cache or encoder counters")
    return ScrapeResult(snapshot)


async def scrape_settled(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], max_wait_s: float = 2.0
) -> ScrapeResult:
    """Scrapes until two reads agree: an engine may publish its counters a step after the last
    response went out, and an early read would drop those from the run."""
    result = await scrape(client, url, headers)
    waited_s = 0.0
    while result.snapshot is not None and waited_s < max_wait_s:
        await asyncio.sleep(0.25)
        waited_s += 0.25
        again = await scrape(client, url, headers)
        if again.snapshot is None or _counters(again.snapshot) == _counters(result.snapshot):
            return result if again.snapshot is None else again
        result = again
    return result


def _counters(s: MetricsSnapshot) -> dict[str, float]:
    return {k: v for k, v in s.samples.items() if k.startswith("mmserve_") and "_total" in k}


def _delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> float | None:
    a, b = after.counter(name), before.counter(name)
    return None if a is None or b is None else a - b


def _rate(hits: float | None, queries: float | None) -> float | None:
    return None if hits is None or not queries else hits / queries


def _tier(before: MetricsSnapshot, after: MetricsSnapshot, prefix: str, labels: str = "") -> dict:
    q_name, h_name = prefix + "_queries" + labels, prefix + "_hits" + labels
    queries, hits = _delta(before, after, q_name), _delta(before, after, h_name)
    return {
        "queries": queries,
        "hits": hits,
        "hit_rate": _rate(hits, queries),
        "hit_rate_before": _rate(before.counter(h_name), before.counter(q_name)),
        "hit_rate_after": _rate(after.counter(h_name), after.counter(q_name)),
    }


def diff_snapshots(before: MetricsSnapshot, after: MetricsSnapshot) -> dict:
    """The run's share of each counter; hit rates over the run and cumulative before/after.
    A data-parallel server's also by replica (`replicas`, from the replicas present after the
    run: one that restarted counts on from where it was) and its routing by reason."""
    tiers = {tier: _tier(before, after, prefix) for tier, prefix in CACHE_TIERS}
    counters = {name: _delta(before, after, prefix) for name, prefix in COUNTERS}
    result = {"available": True, "reason": None, "cache_tiers": tiers, **counters}
    if after.replicas:
        prefixes = dict(CACHE_TIERS) | dict(COUNTERS)
        result["replicas"] = {
            replica: {
                "cache_tiers": {
                    t: _tier(before, after, prefixes[t], f'{{replica="{replica}"}}')
                    for t in REPLICA_TIERS
                },
                **{
                    c: _delta(before, after, f'{prefixes[c]}{{replica="{replica}"}}')
                    for c in REPLICA_COUNTERS
                },
            }
            for replica in after.replicas
        }
        result["routed_requests"] = {
            reason: _delta(before, after, f'{ROUTED}{{reason="{reason}"}}')
            for reason in ROUTED_REASONS
        }
    return result


def unavailable(reason: str) -> dict:
    return {"available": False, "reason": reason}
