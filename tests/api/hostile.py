"""Tools for the hostile-request battery: raw HTTP, a local media server, RSS, an innocent asker."""

from __future__ import annotations

import base64
import io
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from tests.support.harness import Server
from tests.support.media_server import running_media_server

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
INNOCENT_QUESTION = "What is in the image?"


def png_data_url(image: Image.Image, **save_kwargs: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **save_kwargs)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def example(name: str) -> Image.Image:
    return Image.open(EXAMPLES / f"{name}.png").convert("RGB")


def chat_body(image_url: str, question: str = INNOCENT_QUESTION, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "mmserve-toy",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": question},
                ],
            }
        ],
    }
    body.update(extra)
    return body


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict[str, Any]

    @property
    def param(self) -> str | None:
        return (self.body.get("error") or {}).get("param")

    @property
    def message(self) -> str:
        return (self.body.get("error") or {}).get("message", "")

    @property
    def text(self) -> str:
        return self.body["choices"][0]["message"]["content"].strip()


def post(
    server: Server,
    body: dict[str, Any] | str | bytes,
    *,
    path: str = "/v1/chat/completions",
    key: str | None = None,
    content_type: str = "application/json",
    timeout_s: float = 60.0,
) -> Reply:
    """POST a body (a dict is sent as JSON; str/bytes are sent exactly as given)."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    raw = raw.encode() if isinstance(raw, str) else raw
    headers = {"content-type": content_type}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    resp = httpx.post(server.url + path, content=raw, headers=headers, timeout=timeout_s)
    try:
        payload = resp.json()
    except ValueError:
        payload = {"raw": resp.text}
    return Reply(resp.status_code, payload)


def healthy(server: Server) -> bool:
    return httpx.get(server.url + "/health", timeout=10).status_code == 200


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (decode workers included)."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for child in children:
        out += [int(child), *_descendants(int(child))]
    return out


def raw_exchange(port: int, data: bytes, *, wait_s: float) -> bytes:
    """Send raw bytes on a fresh connection; return whatever comes back within wait_s."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(data)
        chunks = []
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def is_closed(sock: socket.socket, wait_s: float) -> bool:
    """True when the peer closed the connection (recv gives EOF or a reset) within wait_s."""
    sock.settimeout(wait_s)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


@contextmanager
def media_server(images: dict[str, Image.Image]) -> Iterator[int]:
    """Serve PNGs at /<name>.png and a slow trickle at /slow.png; yields the port."""
    files = {f"/{name}.png": _png(image) for name, image in images.items()}
    with running_media_server(files) as srv:
        yield srv.port


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
