"""The names of every series an engine keeps, their labels and buckets, and which of them the
engine core counts (a data-parallel engine keeps those per replica)."""

from __future__ import annotations

from types import MappingProxyType

# Counters (monotonic) and gauges the engine keeps; names map 1:1 onto the Prometheus names
# `mmserve_<name>` (counters get `_total` appended by the exporter). docs/metrics.md lists
# every series with its unit and its vLLM counterpart.
COUNTER_NAMES = (
    "processor_cache_queries",
    "processor_cache_hits",
    "encoder_cache_queries",
    "encoder_cache_hits",
    "encoder_items_encoded",
    "encoder_forward_calls",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "embedding_transfer_bytes",
    "prompt_tokens",
    "generation_tokens",
    "requests_finished",
    "requests_failed",
    "num_preemptions",
    "remote_encoder_retries",
    "remote_encoder_fallbacks",
)
GAUGE_NAMES = (
    "kv_blocks_free",
    "kv_blocks_total",
    "encoder_cache_used_slots",
    "encoder_cache_resident_slots",
    "encoder_cache_total_slots",
    "num_requests_running",
    "num_requests_waiting",
    "encoder_pool_bytes",
    "remote_encoder_healthy",
    "remote_encoder_items_in_flight",
)
# Counters also kept per item modality: their samples carry a `modality` label (one per entry
# of MODALITIES, present from the start; the unlabelled total is their sum).
MODALITY_COUNTERS = ("encoder_items_encoded", "encoder_forward_calls")
MODALITIES = ("image", "video")
# Counters kept per value of one label (counter name -> label name), the label values appearing
# as they are first counted (an encoder's URL, a drop reason). A name also in COUNTER_NAMES
# keeps its unlabelled total there; the others are exported only by label. Values may be
# fractional (a latency sum in seconds).
LABELLED_COUNTERS = MappingProxyType(
    {
        "embedding_transfer_bytes": "direction",  # "sent" (item payloads) | "received" (embeddings)
        "remote_encoder_items": "encoder",
        "remote_encoder_latency_seconds": "encoder",
        "remote_encoder_dropped_messages": "reason",
        # requests a data-parallel engine routed (API process), by why it chose the replica:
        # "affinity" (the one the request's content ranks first) or "load" (that one was busy)
        "dp_routed_requests": "reason",
    }
)
# Label values present from the start (at 0), so their series exist before anything is counted.
LABEL_VALUES_FROM_START = MappingProxyType({"embedding_transfer_bytes": ("sent", "received")})
# The reasons of dp_routed_requests, at 0 from the start on a data-parallel engine.
DP_ROUTED_REASONS = ("affinity", "load")
# The finish reasons a finished request is counted under (request_success{finished_reason}):
# the OpenAI finish_reason values of scheduling.request.FINISH_REASONS.
FINISHED_REASONS = ("stop", "length", "abort", "error")

# Every bound vLLM uses for the same series (so a query on any `le` works), plus mmserve's
# finer low ones.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's buckets for its per-request phase histograms, so that dashboards bucket alike.
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Per-request token-count histograms bucket 1, 2, 5, 10, 20, 50, ... up to this many tokens
# when the engine's max_model_len is not given.
DEFAULT_MAX_TOKEN_BUCKET = 1_000_000

# Histograms that time a finished request's phases (observed once per finished request).
PHASE_HISTOGRAMS = (
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
)
TOKEN_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens")
HISTOGRAM_NAMES = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    *PHASE_HISTOGRAMS,
    *TOKEN_HISTOGRAMS,
)

# SchedulerStats field -> (kind, metric name): the one table both the engine and the API
# process's mirror of a remote engine's stats read.
SCHEDULER_METRICS = (
    ("num_running", "gauge", "num_requests_running"),
    ("num_waiting", "gauge", "num_requests_waiting"),
    ("num_free_kv_blocks", "gauge", "kv_blocks_free"),
    ("encoder_cache_used_slots", "gauge", "encoder_cache_used_slots"),
    ("encoder_cache_resident_slots", "gauge", "encoder_cache_resident_slots"),
    ("prefix_cache_queries", "counter", "prefix_cache_queries"),
    ("prefix_cache_hits", "counter", "prefix_cache_hits"),
    ("encoder_cache_queries", "counter", "encoder_cache_queries"),
    ("encoder_cache_hits", "counter", "encoder_cache_hits"),
    ("encoder_pool_bytes", "gauge", "encoder_pool_bytes"),
    ("encoder_inflight_items", "gauge", "remote_encoder_items_in_flight"),
)
# What the engine core counts itself (beyond SCHEDULER_METRICS): an engine process sends these
# with its stats, and the API process mirrors them. Everything else (tokens, requests, latency,
# the processor cache, the routing of a data-parallel engine) is counted where the outputs are
# made.
CORE_COUNTERS = (
    "encoder_items_encoded",
    "encoder_forward_calls",
    "embedding_transfer_bytes",
    "num_preemptions",
    "remote_encoder_retries",
    "remote_encoder_fallbacks",
)
CORE_GAUGES = (
    "kv_blocks_total",
    "encoder_cache_total_slots",
    "remote_encoder_healthy",
)
# The labelled counters the API process counts (the others are the engine core's).
FRONT_LABELLED_COUNTERS = ("dp_routed_requests",)
# Every series of the engine core: a data-parallel engine keeps them per replica (one
# EngineMetrics each) and exports each replica's with a `replica` label beside their total. All
# the others (requests, tokens, latency, the processor cache) are the API process's, kept once.
CORE_SERIES = frozenset(
    {metric for _, _, metric in SCHEDULER_METRICS}
    | set(CORE_COUNTERS)
    | set(CORE_GAUGES)
    | set(MODALITY_COUNTERS)
    | set(LABELLED_COUNTERS).difference(FRONT_LABELLED_COUNTERS)
)
# How the replicas' gauges make the engine's: summed, but for the encoders in rotation (every
# replica reaches the same pool, so the total is the most any replica has in rotation).
GAUGE_AGGREGATES = MappingProxyType({"remote_encoder_healthy": "max"})
