"""The encoder server's Prometheus series, in a registry of its own (no global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

PREFIX = "mmserve_encoder_"


class EncoderMetrics:
    """Counters the worker and the HTTP routes bump; gauges read live values when scraped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.items_received = Counter(
            PREFIX + "items_received", "Encode items received (items).", registry=r
        )
        self.items_encoded = Counter(
            PREFIX + "items_encoded", "Items run through the vision tower (items).", registry=r
        )
        self.forward_calls = Counter(
            PREFIX + "forward_calls", "Calls of the vision tower (batches).", registry=r
        )
        self.cache_queries = Counter(
            PREFIX + "cache_queries", "Items looked up in the embedding cache (items).", registry=r
        )
        self.cache_hits = Counter(
            PREFIX + "cache_hits", "Items answered from the embedding cache (items).", registry=r
        )
        self.deduplicated = Counter(
            PREFIX + "items_deduplicated",
            "Items that joined an identical item already being encoded (items).",
            registry=r,
        )
        self.item_errors = Counter(
            PREFIX + "item_errors",
            "Items answered with an error, by code (items).",
            ["code"],
            registry=r,
        )
        self.cancelled = Counter(
            PREFIX + "items_cancelled", "Queued items a client cancelled (items).", registry=r
        )
        self.received_bytes = Counter(
            PREFIX + "received_bytes", "Item payload bytes received over ZMQ (bytes).", registry=r
        )
        self.sent_bytes = Counter(
            PREFIX + "sent_bytes", "Embedding bytes sent over ZMQ (bytes).", registry=r
        )
        self.malformed = Counter(
            PREFIX + "malformed_messages",
            "ZMQ messages dropped undecoded, by reason (messages).",
            ["reason"],
            registry=r,
        )
        self.plan_requests = Counter(
            PREFIX + "plan_requests",
            "POST /v1/encode/plan requests, by outcome ('ok' or an error code).",
            ["outcome"],
            registry=r,
        )

    def add_gauges(
        self,
        *,
        queued_patches: Callable[[], int],
        queued_items: Callable[[], int],
        cache_bytes: Callable[[], int],
        plan_store_bytes: Callable[[], int],
    ) -> None:
        for name, doc, read in (
            (
                "queued_patches",
                "Input patches of items waiting to be answered (patches).",
                queued_patches,
            ),
            ("queued_items", "Items waiting to be answered (items).", queued_items),
            ("cache_bytes", "Bytes of embeddings in the cache (bytes).", cache_bytes),
            ("plan_store_bytes", "Bytes of URL media kept from plans (bytes).", plan_store_bytes),
        ):
            Gauge(PREFIX + name, doc, registry=self.registry).set_function(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)
