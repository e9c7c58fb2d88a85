"""A fake `mmserve encode` for the pool's tests: a ZMQ ROUTER thread and a tiny HTTP server.

It answers EncodeItem with embeddings from a formula (so a test can check every value), or
misbehaves on demand: errors, hangs, answers twice, answers an older attempt, sends garbage,
truncated or unsigned frames, stops answering pings. `/v1/encode/info` and `/v1/encode/plan`
answer from fields a test sets.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
import zmq

from mmserve.disaggregation.protocol import (
    ENCODER_PROTOCOL_VERSION,
    Cancel,
    EncodeItem,
    EncodeResult,
    MalformedMessage,
    Ping,
    Pong,
    decode_message,
    encode_message,
)

HIDDEN = 8
MERGE = 2
FINGERPRINT = "f" * 64


def expected_embeddings(
    identifier: str, grid_thw: tuple[int, int, int], width: int = HIDDEN
) -> np.ndarray:
    """[num_embeds, width] float32: what the fake encoder answers for this item (`width`: its
    behaviour's embedding_width, HIDDEN x (1 + DeepStack levels))."""
    t, h, w = grid_thw
    num_embeds = t * h * w // (MERGE * MERGE)
    base = int(identifier[:4], 16) % 97
    return np.arange(num_embeds * width, dtype=np.float32).reshape(num_embeds, width) + base


def _as_dtype(emb: np.ndarray, dtype: str) -> bytes:
    tensor = torch.from_numpy(emb).to(getattr(torch, dtype)).contiguous()
    return tensor.view(torch.uint8).numpy().tobytes()


@dataclass
class Behaviour:
    """What the fake does; a test changes fields while it runs."""

    mode: str = "ok"  # ok | error | hang | twice | stale_first | garbage_first | bad_payload
    error_code: str = "internal"
    answer_pings: bool = True
    queued_patches: int = 0
    reply_delay_s: float = 0.0
    dtype: str = "float32"
    embedding_width: int = HIDDEN  # the rows it answers: a DeepStack model's are wider
    protocol_version: int | None = ENCODER_PROTOCOL_VERSION  # None: an encoder of version 1
    fingerprint: str = FINGERPRINT
    plan: dict | None = None  # the /v1/encode/plan answer; None: 502
    plan_status: int = 200
    sign_with: bytes | None = None  # sign replies with this secret instead of the shared one


@dataclass
class FakeEncoder:
    secret: bytes | None = None
    behaviour: Behaviour = field(default_factory=Behaviour)

    def __post_init__(self) -> None:
        self.items: list[EncodeItem] = []
        self.cancels: list[Cancel] = []
        self.pings = 0
        self.plan_requests: list[tuple[dict, str | None]] = []
        self._last_peer = b""
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.zmq_port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._zmq_thread = threading.Thread(target=self._serve_zmq, daemon=True)
        self._zmq_thread.start()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._http.daemon_threads = True
        threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def zmq_address(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    def info(self) -> dict:
        b = self.behaviour
        if b.protocol_version is None:  # what an encoder of protocol 1 answered
            width = {"hidden_size": b.embedding_width}
        else:
            width = {"protocol_version": b.protocol_version, "embedding_width": b.embedding_width}
        return {
            "zmq_port": self.zmq_port,
            "model_fingerprint": b.fingerprint,
            **width,
            "dtype": b.dtype,
            "spatial_merge_size": MERGE,
            "patch_size": 14,
            "temporal_patch_size": 2,
        }

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._zmq_thread.join(timeout=5)
        self._router.close(linger=0)
        self._ctx.term()
        self._http.shutdown()
        self._http.server_close()

    def wait_for_items(self, count: int, timeout_s: float = 5.0) -> list[EncodeItem]:
        deadline = time.monotonic() + timeout_s
        while len(self.items) < count and time.monotonic() < deadline:
            time.sleep(0.005)
        return list(self.items)

    def send_raw(self, frames: list[bytes]) -> None:
        """Send frames to the last client that talked to us (garbage tests)."""
        with self._lock:
            self._router.send_multipart([self._last_peer, *frames])

    # ------------------------------------------------------------------ ZMQ

    def _serve_zmq(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        delayed: list[tuple[float, bytes, EncodeItem]] = []
        while not self._stop.is_set():
            if poller.poll(10):
                with self._lock:
                    frames = self._router.recv_multipart()
                    self._last_peer = frames[0]
                self._on_message(frames[0], frames[1:], delayed)
            now = time.monotonic()
            for entry in [d for d in delayed if d[0] <= now]:
                delayed.remove(entry)
                self._answer(entry[1], entry[2])

    def _on_message(self, peer: bytes, frames: list[bytes], delayed: list) -> None:
        try:
            msg, _ = decode_message(frames, self.secret)
        except MalformedMessage:
            return
        b = self.behaviour
        if isinstance(msg, Ping):
            self.pings += 1
            if b.answer_pings:
                self._send(peer, Pong(msg.nonce, b.queued_patches, b.fingerprint))
        elif isinstance(msg, Cancel):
            self.cancels.append(msg)
        elif isinstance(msg, EncodeItem):
            self.items.append(msg)
            if b.mode == "hang":
                return
            if b.reply_delay_s:
                delayed.append((time.monotonic() + b.reply_delay_s, peer, msg))
            else:
                self._answer(peer, msg)

    def _answer(self, peer: bytes, item: EncodeItem) -> None:
        b = self.behaviour
        if b.mode == "error":
            result = EncodeResult(
                item.request_id,
                item.item_index,
                item.identifier,
                item.attempt,
                item.item.grid_thw,
                "float32",
                (1, HIDDEN),
                error_code=b.error_code,
                error_message=f"fake {b.error_code}",
            )
            self._send(peer, result)
            return
        emb = expected_embeddings(item.identifier, item.item.grid_thw, b.embedding_width)
        data = _as_dtype(emb, b.dtype)
        if b.mode == "garbage_first":
            self._send_frames(peer, [b"\xc1not msgpack", b"", b""])
            self._send_frames(peer, [b"only one frame"])
            good = encode_message(self._result(item, emb), emb.tobytes(), self.secret)
            self._send_frames(peer, [bytes(good[0])[:-3], bytes(good[1]), bytes(good[2])])
            self._send_frames(peer, [bytes(f) for f in encode_message(self._result(item, emb))])
        if b.mode == "stale_first":
            self._send(peer, self._result(item, emb, attempt=item.attempt - 1), data)
        if b.mode == "bad_payload":
            self._send(peer, self._result(item, emb), data[:-4])
            return
        self._send(peer, self._result(item, emb), data)
        if b.mode == "twice":
            self._send(peer, self._result(item, emb), data)

    def _result(self, item: EncodeItem, emb: np.ndarray, attempt: int | None = None):
        return EncodeResult(
            item.request_id,
            item.item_index,
            item.identifier,
            item.attempt if attempt is None else attempt,
            item.item.grid_thw,
            self.behaviour.dtype,
            (emb.shape[0], emb.shape[1]),
        )

    def _send(self, peer: bytes, msg, payload: bytes = b"") -> None:
        secret = self.behaviour.sign_with or self.secret
        self._send_frames(peer, [bytes(f) for f in encode_message(msg, payload, secret)])

    def _send_frames(self, peer: bytes, frames: list[bytes]) -> None:
        with self._lock:
            self._router.send_multipart([peer, *frames])


def _handler_for(fake: FakeEncoder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _authorized(self) -> bool:
            if fake.secret is None:
                return True
            return self.headers.get("Authorization") == f"Bearer {fake.secret.decode()}"

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if not self._authorized():
                self._reply(401, {"error": {"code": "unauthorized", "message": "no"}})
            elif self.path == "/v1/encode/info":
                self._reply(200, fake.info())
            else:
                self._reply(404, {"error": {"code": "not_found", "message": self.path}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            fake.plan_requests.append((body, self.headers.get("Authorization")))
            if not self._authorized():
                self._reply(401, {"error": {"code": "unauthorized", "message": "no"}})
            elif self.path != "/v1/encode/plan" or fake.behaviour.plan is None:
                self._reply(502, {"error": {"code": "internal", "message": "no plan"}})
            else:
                self._reply(fake.behaviour.plan_status, fake.behaviour.plan)

    return Handler
