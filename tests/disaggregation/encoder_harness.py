"""A real `mmserve encode` server run in-process (a thread with its own event loop), a ZMQ
client for it, and the local vision tower as the oracle."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import numpy as np
import torch
import zmq
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from mmserve.cli import build_parser
from mmserve.disaggregation.encode_args import EncodeServerConfig
from mmserve.disaggregation.encoder_server import EncoderServer
from mmserve.disaggregation.protocol import (
    EncodeItem,
    EncodeResult,
    Message,
    content_digest,
    decode_message,
    encode_message,
)
from mmserve.models.loader import load_model
from mmserve.multimodal import RemoteItem
from mmserve.processing.image_decode import decode_image_bytes
from mmserve.processing.image_processor import (
    ImageProcessorConfig,
    get_grid_thw,
    process_image,
)
from tests.support.factory import random_image

MIN_PIXELS = 56 * 56
MAX_PIXELS = 128 * 128


def encoder_config(
    model_dir: Path, port: int, *flags: str, environ: Mapping[str, str] | None = None
) -> EncodeServerConfig:
    ns = build_parser(with_bench=False).parse_args(
        ["encode", "--model", str(model_dir), "--port", str(port), *flags]
    )
    return EncodeServerConfig.from_cli(ns, environ or {})


@contextlib.contextmanager
def running_encoder(config: EncodeServerConfig) -> Iterator[EncoderServer]:
    server = EncoderServer(config, decode_workers=0)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # noqa: BLE001 - reported by the waiting test
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_healthy(f"http://127.0.0.1:{config.port}", thread)
        yield server
    finally:
        server.stop()
        thread.join(15)
    assert not failure, failure


def wait_healthy(base: str, alive: threading.Thread | None = None, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive.is_alive():
            raise RuntimeError("the encoder server stopped before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{base} did not become healthy in {timeout_s} s")


def metric(base: str, name: str, **labels: str) -> float:
    """One sample of the encoder's /metrics (0 when the series has no sample yet)."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


class EncoderClient:
    """One DEALER, as a language-model server holds one per encoder."""

    def __init__(self, zmq_port: int, secret: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://127.0.0.1:{zmq_port}")
        self.secret = secret

    def send(self, msg: Message, payload: bytes = b"") -> None:
        self.socket.send_multipart(encode_message(msg, payload, self.secret))

    def send_raw(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def recv(self, timeout_s: float = 30) -> tuple[Message, bytes]:
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply from the encoder in {timeout_s} s")
        msg, payload = decode_message(self.socket.recv_multipart(), self.secret)
        return msg, bytes(payload)

    def encode(self, item: EncodeItem) -> tuple[EncodeResult, bytes]:
        self.send(item)
        result, data = self.recv()
        assert isinstance(result, EncodeResult)
        return result, data

    def close(self) -> None:
        self.socket.close()
        self.ctx.term()


def png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    random_image(width, height, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


def planned_grid(model_dir: Path, width: int, height: int) -> tuple[int, int, int]:
    cfg = image_config(model_dir)
    return get_grid_thw(width, height, cfg)


def image_config(model_dir: Path) -> ImageProcessorConfig:
    return ImageProcessorConfig.from_pretrained(model_dir).with_overrides(
        {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    )


def bytes_item(
    model_dir: Path,
    data: bytes,
    identifier: str = "id-1",
    *,
    request_id: str = "r1",
    item_index: int = 0,
    attempt: int = 0,
    **kw,
) -> EncodeItem:
    """An item of `data` ("bytes" unless `source` says otherwise); `kw` sets RemoteItem fields
    (the payload is `data` for "bytes", none for "url")."""
    width, height = Image.open(io.BytesIO(data)).size
    source = kw.get("source", "bytes")
    fields = dict(
        source=source,
        payload=None if source == "url" else data,
        url=None,
        rgb_size=None,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        grid_thw=planned_grid(model_dir, width, height),
        content_digest=content_digest(data),
    )
    fields.update(kw)
    return EncodeItem(request_id, item_index, identifier, attempt, RemoteItem(**fields))


class LocalTower:
    """The language-model server's own path: the full checkpoint, decode, process, encode."""

    def __init__(self, model_dir: Path) -> None:
        self.model, _ = load_model(model_dir, dtype=torch.float32)
        self.cfg = image_config(model_dir)

    def embed_image(self, image: Image.Image) -> np.ndarray:
        processed = process_image(image, self.cfg)
        pixels = torch.from_numpy(processed.normalized())
        with torch.inference_mode():
            (emb,) = self.model.embed_multimodal(pixels, [processed.grid_thw])
        return emb.numpy()

    def embed_bytes(self, data: bytes) -> np.ndarray:
        return self.embed_image(decode_image_bytes(data))


def as_array(result: EncodeResult, data: bytes) -> np.ndarray:
    assert result.error_code is None, result.error_message
    assert result.dtype == "float32"
    return np.frombuffer(data, dtype=np.float32).reshape(result.shape)
