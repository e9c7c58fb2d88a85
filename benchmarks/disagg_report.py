"""The arithmetic and the Markdown of `disagg_compare.py`: medians of A (serve alone) and B
(serve + 2 encode servers), bytes shipped per image token against the KV bytes of that token.

Only the standard library: the functions take the run's JSON document (or parts of it), so
tests feed them canned values and `disagg_compare.py --report FILE.json` prints a saved run.

Per token, for a model of hidden size d, L layers, H_kv KV heads of head_dim h, b bytes a value
and S DeepStack levels (Qwen3-VL; 0 for Qwen2-VL and Qwen2.5-VL):

    embedding shipped   d * (1 + S) * b   (one vision-tower output row per image token)
    KV it becomes       2 * L * H_kv * h * b   (K and V, every layer)
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

DEPLOYMENTS = {"A": "serve alone", "B": "serve + 2 encode"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# (field of a run's "bench", row label)
BENCH_ROWS = (
    ("request_throughput", "Request throughput (req/s)"),
    ("output_throughput", "Output tokens/s"),
    ("ttft_p50_ms", "TTFT p50 (ms)"),
    ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("e2el_p50_ms", "E2E latency p50 (ms)"),
)


class ModelShape(NamedTuple):
    """What the bytes per token depend on."""

    name: str
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    patch_size: int = 14
    merge_size: int = 2
    deepstack_levels: int = 0  # extra per-level rows beside the main embedding (Qwen3-VL)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def embedding_bytes_per_token(self) -> int:
        return self.hidden_size * (1 + self.deepstack_levels) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def embedding_to_kv_ratio(self) -> float:
        return self.embedding_bytes_per_token / self.kv_bytes_per_token

    def image_tokens(self, width: int, height: int) -> int:
        """Image tokens of a picture whose sides are multiples of patch x merge (smart_resize
        keeps those as they are): one token per merged (patch * merge)^2 square."""
        side = self.patch_size * self.merge_size
        if width % side or height % side:
            raise ValueError(
                f"image size {width}x{height}: both sides must be multiples of {side} "
                "(patch_size x spatial_merge_size) for the token count to be exact"
            )
        return (width // side) * (height // side)


# Qwen2-VL-7B-Instruct's published config.json: 28 layers, 4 KV heads of 128, hidden 3584, bf16.
QWEN2_VL_7B = ModelShape("Qwen2-VL-7B", 3584, 28, 4, 128, "bfloat16")


def model_shape(name: str, config: dict, dtype: str) -> ModelShape:
    """The shape of a Qwen2-VL / Qwen2.5-VL config.json (text fields flat, as transformers 4
    writes them, or under "text_config", as transformers 5 does), served in `dtype`."""
    text = config.get("text_config") or config
    vision = config["vision_config"]
    num_heads = text["num_attention_heads"]
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return ModelShape(
        name=name,
        hidden_size=text["hidden_size"],
        num_layers=text["num_hidden_layers"],
        num_kv_heads=text.get("num_key_value_heads", num_heads),
        head_dim=text.get("head_dim") or text["hidden_size"] // num_heads,
        dtype=dtype,
        patch_size=vision.get("patch_size", 14),
        merge_size=vision.get("spatial_merge_size", 2),
        deepstack_levels=len(vision.get("deepstack_visual_indexes") or ()),
    )


def shape_of(document: dict) -> ModelShape:
    return ModelShape(**document["model"])


def medians(runs: list[dict], workload: str, deployment: str) -> dict[str, float] | None:
    """Median over rounds of each bench figure, or None when no run of that pair exists."""
    chosen = [
        r["bench"] for r in runs if (r["workload"], r["deployment"]) == (workload, deployment)
    ]
    if not chosen:
        return None
    return {field: statistics.median(b[field] for b in chosen) for field, _ in BENCH_ROWS}


class TransferCheck(NamedTuple):
    """B's embedding bytes over one run, against the image tokens that run sent."""

    num_images: int
    num_image_tokens: int
    received_bytes: int
    expected_bytes: int  # num_image_tokens x hidden x dtype bytes
    encoder_sent_bytes: int  # what the encoders say they sent
    fallbacks: int
    retries: int

    @property
    def is_exact(self) -> bool:
        return self.received_bytes == self.expected_bytes == self.encoder_sent_bytes


def transfer_check(run: dict, shape: ModelShape) -> TransferCheck:
    images, lm = run["images"], run["lm"]
    return TransferCheck(
        num_images=images["num_images"],
        num_image_tokens=images["num_image_tokens"],
        received_bytes=int(lm["embedding_bytes_received"]),
        expected_bytes=images["num_image_tokens"] * shape.embedding_bytes_per_token,
        encoder_sent_bytes=int(sum(e["sent_bytes"] for e in run["encoders"].values())),
        fallbacks=int(lm["fallbacks"]),
        retries=int(lm["retries"]),
    )


class TransferTotals(NamedTuple):
    num_images: int
    num_image_tokens: int
    received_bytes: int
    bytes_per_image: float
    bytes_per_image_token: float
    kv_bytes_per_image_token: int
    measured_ratio: float  # embedding bytes received / KV bytes of the same tokens
    num_runs: int
    num_exact_runs: int


def transfer_totals(runs: list[dict], shape: ModelShape) -> TransferTotals | None:
    """Every B run's bytes added up; None without a B run that sent images."""
    checks = [transfer_check(r, shape) for r in runs if r["deployment"] == "B"]
    num_images = sum(c.num_images for c in checks)
    num_tokens = sum(c.num_image_tokens for c in checks)
    if not num_images:
        return None
    received = sum(c.received_bytes for c in checks)
    kv_bytes = num_tokens * shape.kv_bytes_per_token
    return TransferTotals(
        num_images=num_images,
        num_image_tokens=num_tokens,
        received_bytes=received,
        bytes_per_image=received / num_images,
        bytes_per_image_token=received / num_tokens,
        kv_bytes_per_image_token=shape.kv_bytes_per_token,
        measured_ratio=received / kv_bytes,
        num_runs=len(checks),
        num_exact_runs=sum(c.is_exact for c in checks),
    )


def _n(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def bench_table(runs: list[dict], workload: str) -> list[str]:
    a, b = medians(runs, workload, "A"), medians(runs, workload, "B")
    if a is None or b is None:
        return [f"(workload {workload}: no result from one of the deployments)"]
    num_rounds = min(
        sum((r["workload"], r["deployment"]) == (workload, d) for r in runs) for d in "AB"
    )
    lines = [
        f"Workload `{workload}`, medians over {num_rounds} rounds:",
        "",
        f"| Figure | A: {DEPLOYMENTS['A']} | B: {DEPLOYMENTS['B']} | B/A |",
        "|---|---:|---:|---:|",
    ]
    for field, label in BENCH_ROWS:
        ratio = b[field] / a[field] if a[field] else float("nan")
        lines.append(f"| {label} | {_n(a[field])} | {_n(b[field])} | {ratio:.2f}x |")
    return lines


def run_lines(runs: list[dict]) -> list[str]:
    lines = [
        "| Round | Workload | Deployment | Seed | Completed | req/s | TTFT p50 (ms) | "
        "Images | Image tokens | Remote items per encoder | Fallbacks |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        bench, lm = r["bench"], r["lm"]
        per_encoder = " / ".join(f"{n:g}" for n in lm["remote_items"].values()) or "-"
        lines.append(
            f"| {r['round']} | {r['workload']} | {r['deployment']} | {r['seed']} | "
            f"{bench['completed']}/{bench['num_requests']} | {bench['request_throughput']:.2f} | "
            f"{bench['ttft_p50_ms']:.0f} | {r['images']['num_images']} | "
            f"{r['images']['num_image_tokens']} | {per_encoder} | {lm['fallbacks']:g} |"
        )
    return lines


def bytes_lines(document: dict) -> list[str]:
    shape, runs = shape_of(document), document["runs"]
    totals = transfer_totals(runs, shape)
    big = QWEN2_VL_7B
    lines = [
        "| Per image token | "
        f"{shape.name} (hidden {shape.hidden_size}, {shape.num_layers} layers, "
        f"{shape.num_kv_heads}x{shape.head_dim} KV, {shape.dtype}) | "
        f"{big.name} (hidden {big.hidden_size}, {big.num_layers} layers, "
        f"{big.num_kv_heads}x{big.head_dim} KV, {big.dtype}) |",
        "|---|---:|---:|",
        f"| Embedding bytes (hidden x (1 + DeepStack levels) x dtype) | "
        f"{shape.embedding_bytes_per_token:,} | "
        f"{big.embedding_bytes_per_token:,} |",
        f"| KV bytes (2 x layers x KV heads x head_dim x dtype) | {shape.kv_bytes_per_token:,} "
        f"| {big.kv_bytes_per_token:,} |",
        f"| Embedding / KV | {shape.embedding_to_kv_ratio:.3f} | {big.embedding_to_kv_ratio:.3f} |",
    ]
    if totals is None:
        return [*lines, "", "No B run sent images: nothing measured."]
    lines += [
        "",
        f"Measured over the {totals.num_runs} B runs: {totals.num_images} images, "
        f"{totals.num_image_tokens:,} image tokens, {totals.received_bytes:,} embedding bytes "
        f"received by the LM server: {totals.bytes_per_image:,.0f} bytes per image, "
        f"{totals.bytes_per_image_token:,.1f} per image token against "
        f"{totals.kv_bytes_per_image_token:,} KV bytes for the same token "
        f"(ratio {totals.measured_ratio:.3f}). Received = image tokens x hidden x "
        f"{shape.dtype_bytes} = bytes the encoders sent, exactly, in "
        f"{totals.num_exact_runs} of {totals.num_runs} runs.",
        "",
        "Per image of each size in the workloads:",
        "",
        f"| Image | Tokens | {shape.name} embeddings / KV | {big.name} embeddings / KV |",
        "|---|---:|---:|---:|",
    ]
    sizes = sorted({tuple(s) for w in document["workloads"] for s in w["image_sizes"]})
    for width, height in sizes:
        num_tokens = shape.image_tokens(width, height)
        big_tokens = big.image_tokens(width, height)
        lines.append(
            f"| {width}x{height} | {num_tokens} | "
            f"{num_tokens * shape.embedding_bytes_per_token / 1024:,.0f} KiB / "
            f"{num_tokens * shape.kv_bytes_per_token / 1024:,.0f} KiB | "
            f"{_mib(big_tokens * big.embedding_bytes_per_token)} / "
            f"{_mib(big_tokens * big.kv_bytes_per_token)} |"
        )
    return lines


def encoder_lines(runs: list[dict]) -> list[str]:
    """Where images were encoded, and the pool's own view summed over B runs (encoders by
    position: every round starts new ones on new ports)."""
    a_runs = [r for r in runs if r["deployment"] == "A"]
    b_runs = [r for r in runs if r["deployment"] == "B"]
    items = [0.0] * max((len(r["lm"]["remote_items"]) for r in b_runs), default=0)
    latency_s = [0.0] * len(items)
    for r in b_runs:
        for i, enc in enumerate(sorted(r["lm"]["remote_items"])):
            items[i] += r["lm"]["remote_items"][enc]
            latency_s[i] += r["lm"]["remote_latency_s"].get(enc, 0.0)

    def b_sum(key: str) -> float:
        return sum(r["lm"][key] for r in b_runs)

    def images(rs: list[dict]) -> int:
        return sum(r["images"]["num_images"] for r in rs)

    per_encoder = ", ".join(
        f"encode{i} {n:g} images (mean send-to-answer {1000 * latency_s[i] / n:.0f} ms)"
        for i, n in enumerate(items)
        if n
    )
    encoders = [e for r in b_runs for e in r["encoders"].values()]
    sent = b_sum("embedding_bytes_sent")
    return [
        f"Where images were encoded: A {sum(r['lm']['local_items_encoded'] for r in a_runs):g} "
        f"of {images(a_runs)} in the serve process; B {b_sum('local_items_encoded'):g} of "
        f"{images(b_runs)} in the serve process, {sum(items):g} by the pool: "
        f"{per_encoder or 'none'}; {sum(e['items_encoded'] for e in encoders):g} items in "
        f"{sum(e['forward_calls'] for e in encoders):g} vision-tower calls. Image bytes sent to "
        f"the pool: {sent:,.0f} ({sent / max(images(b_runs), 1):,.0f} per image, the JPEG as "
        f"sent by the client). Retries {b_sum('retries'):g}, local fallbacks "
        f"{b_sum('fallbacks'):g}, dropped messages {b_sum('dropped_messages'):g}."
    ]


def markdown(document: dict) -> str:
    runs = document["runs"]
    lines = [
        "## Disaggregated encoding: `serve` alone vs `serve` + 2 `encode` "
        "(`benchmarks/disagg_compare.py`, issue #16)",
        "",
        f"- Date: {document['date']}",
        f"- Commit: {document['commit']}",
        f"- Machine: {document['host']}",
        f"- Checkpoint: {document['checkpoint']}",
        "",
        "```bash",
        document["command"],
        "```",
        "",
    ]
    for workload in document["workloads"]:
        lines += [*bench_table(runs, workload["name"]), ""]
    lines += ["Every run:", "", *run_lines(runs), "", *bytes_lines(document), ""]
    lines += encoder_lines(runs)
    return "\n".join(lines) + "\n"
