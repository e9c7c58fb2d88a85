"""`mmserve encode` in-process: embeddings equal the local vision tower's, the cache and the
dedupe save encodes, bad items and bad frames are answered or dropped, the server stays up."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from mmserve.disaggregation.protocol import (
    ENCODER_PROTOCOL_VERSION,
    Cancel,
    EncodeResult,
    Ping,
    Pong,
    content_digest,
    encode_message,
)
from mmserve.models.config import load_model_config
from mmserve.models.loader import load_vision_tower
from tests.disaggregation.encoder_harness import (
    EncoderClient,
    LocalTower,
    as_array,
    bytes_item,
    encoder_config,
    metric,
    planned_grid,
    png,
    running_encoder,
)
from tests.support.factory import png_bytes, random_image
from tests.support.media_server import running_media_server

# Ports of this module (18100-18199 belong to the encoder tests).
PORTS = {"qwen2_vl": 18110, "qwen2_5_vl": 18112}
SECRET_PORT = 18114
SECRET = b"pool-secret"


@pytest.fixture(scope="module")
def media_server():
    with running_media_server() as srv:
        yield srv


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def encoder(request, media_server) -> Iterator[tuple[str, Path, int]]:
    """(arch, checkpoint, HTTP port) of a running encoder that may fetch from the media server."""
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    port = PORTS[request.param]
    allowed = f"127.0.0.1:{media_server.port}"
    config = encoder_config(model_dir, port, "--allowed-media-domains", allowed)
    with running_encoder(config):
        yield request.param, model_dir, port


@pytest.fixture(scope="module")
def local_towers(qwen2_vl_dir, qwen2_5_vl_dir) -> dict[str, LocalTower]:
    return {"qwen2_vl": LocalTower(qwen2_vl_dir), "qwen2_5_vl": LocalTower(qwen2_5_vl_dir)}


@pytest.fixture
def client(encoder) -> Iterator[EncoderClient]:
    c = EncoderClient(encoder[2] + 1)
    yield c
    c.close()


def test_embeddings_equal_the_local_tower_for_bytes_rgb_and_url(
    encoder, client, local_towers, media_server
):
    arch, model_dir, port = encoder
    local = local_towers[arch]
    data = png(64, 48, seed=3)
    result, payload = client.encode(bytes_item(model_dir, data))
    assert result.cache_hit is False and result.shape[1] == local.model.config.mm_embedding_width
    np.testing.assert_array_equal(as_array(result, payload), local.embed_bytes(data))

    rgb = random_image(40, 56, seed=4)
    raw = rgb.tobytes()
    item = bytes_item(
        model_dir,
        data,
        identifier="rgb-1",
        source="rgb",
        rgb_size=(40, 56),
        payload=raw,
        grid_thw=planned_grid(model_dir, 40, 56),
        content_digest=content_digest(raw),
    )
    result, payload = client.encode(item)
    np.testing.assert_array_equal(as_array(result, payload), local.embed_image(rgb))

    url_data = png_bytes()  # what the media server answers for /img.png
    url = f"{media_server.base}/img.png"
    item = bytes_item(model_dir, url_data, identifier="url-1", source="url", url=url)
    result, payload = client.encode(item)
    np.testing.assert_array_equal(as_array(result, payload), local.embed_bytes(url_data))
    assert metric(f"http://127.0.0.1:{port}", "mmserve_encoder_items_encoded_total") >= 3


def test_vision_only_load_has_no_language_model(encoder, local_towers):
    arch, _, _ = encoder
    full = local_towers[arch].model
    tower, _ = load_vision_tower(encoder[1])
    names = {n for n, _ in tower.named_parameters()}
    assert names == {n.removeprefix("visual.") for n, _ in full.visual.named_parameters()}
    numel = sum(p.numel() for p in tower.parameters())
    assert numel == sum(p.numel() for p in full.visual.parameters())
    assert numel < sum(p.numel() for p in full.parameters())


def test_a_repeated_image_is_a_cache_hit_and_not_encoded_again(encoder, client):
    _, model_dir, port = encoder
    base = f"http://127.0.0.1:{port}"
    item = bytes_item(model_dir, png(32, 32, seed=10), identifier="again")
    first, first_payload = client.encode(item)
    encoded = metric(base, "mmserve_encoder_items_encoded_total")
    hits = metric(base, "mmserve_encoder_cache_hits_total")
    # another identifier for the same bytes: the encoder keys by content, not by the client's id
    second, second_payload = client.encode(
        bytes_item(model_dir, png(32, 32, seed=10), identifier="other-id")
    )
    assert first.cache_hit is False and second.cache_hit is True
    assert second.identifier == "other-id" and second_payload == first_payload
    assert metric(base, "mmserve_encoder_items_encoded_total") == encoded
    assert metric(base, "mmserve_encoder_cache_hits_total") == hits + 1
    assert metric(base, "mmserve_encoder_cache_bytes") >= len(first_payload)


def test_two_clients_sending_the_same_image_encode_it_once(encoder):
    _, model_dir, port = encoder
    base = f"http://127.0.0.1:{port}"
    data = png(96, 80, seed=11)
    encoded = metric(base, "mmserve_encoder_items_encoded_total")
    clients = [EncoderClient(port + 1) for _ in range(2)]
    replies: list[tuple[EncodeResult, bytes]] = []
    barrier = threading.Barrier(2)

    def ask(c: EncoderClient, ident: str) -> None:
        barrier.wait()
        replies.append(c.encode(bytes_item(model_dir, data, identifier=ident)))

    threads = [threading.Thread(target=ask, args=(c, f"lm{i}")) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in clients:
        c.close()
    assert sorted(r.identifier for r, _ in replies) == ["lm0", "lm1"]
    assert replies[0][1] == replies[1][1]
    assert metric(base, "mmserve_encoder_items_encoded_total") == encoded + 1


def test_bad_items_get_error_results_and_the_server_goes_on(encoder, client):
    _, model_dir, port = encoder
    good = png(32, 48, seed=12)
    bad = b"\x89PNG\r\n\x1a\n not really"
    bad_item = bytes_item(model_dir, good, content_digest=content_digest(bad), payload=bad)
    result, payload = client.encode(bad_item)
    assert result.error_code == "invalid_image" and payload == b""
    assert "not a supported image" in (result.error_message or "")
    result, _ = client.encode(bytes_item(model_dir, good, grid_thw=(1, 2, 2)))
    assert result.error_code == "grid_mismatch" and "(1, 2, 2)" in (result.error_message or "")
    result, _ = client.encode(bytes_item(model_dir, good, content_digest="0" * 64))
    assert result.error_code == "content_changed"
    result, payload = client.encode(bytes_item(model_dir, good))
    assert result.error_code is None and len(payload) == result.shape[0] * result.shape[1] * 4
    base = f"http://127.0.0.1:{port}"
    assert metric(base, "mmserve_encoder_item_errors_total", code="grid_mismatch") >= 1


def test_garbage_and_truncated_frames_are_dropped_and_counted(encoder, client):
    _, model_dir, port = encoder
    base = f"http://127.0.0.1:{port}"
    data = png(32, 32, seed=13)
    raw = client.socket  # the frames below bypass the codec
    frames = encode_message(bytes_item(model_dir, data))
    raw.send_multipart([b"garbage"])
    raw.send_multipart([b"\x92\xa3bad", b"", b""])
    raw.send_multipart([bytes(frames[0])[:-5], bytes(frames[1]), b""])  # truncated header
    raw.send_multipart([bytes(frames[0]), bytes(frames[1]), b"x" * 32])  # a mac, no secret
    raw.send_multipart(encode_message(Pong(1, 0, "x")))  # only encoders send pongs
    client.send(Ping(7))
    pong, _ = client.recv()
    assert isinstance(pong, Pong) and pong.nonce == 7 and len(pong.model_fingerprint) == 64
    assert metric(base, "mmserve_encoder_malformed_messages_total", reason="frame_count") >= 1
    assert metric(base, "mmserve_encoder_malformed_messages_total", reason="bad_header") >= 2
    assert metric(base, "mmserve_encoder_malformed_messages_total", reason="unexpected_mac") >= 1
    assert metric(base, "mmserve_encoder_malformed_messages_total", reason="unexpected_kind") >= 1
    result, _ = client.encode(bytes_item(model_dir, data))
    assert result.error_code is None
    client.send(Cancel(["nobody"], [0]))  # cancelling what is not queued is harmless
    client.send(Ping(8))
    pong, _ = client.recv()
    assert isinstance(pong, Pong) and pong.queued_patches == 0


def test_health_info_and_plan(encoder, media_server):
    _, model_dir, port = encoder
    base = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    info = httpx.get(f"{base}/v1/encode/info").json()
    assert info["zmq_port"] == port + 1 and info["dtype"] == "float32"
    assert info["protocol_version"] == ENCODER_PROTOCOL_VERSION
    assert info["embedding_width"] == load_model_config(model_dir).text.hidden_size  # levels 0
    body = {"url": f"{media_server.base}/img.png", "min_pixels": 3136, "max_pixels": 16384}
    answer = httpx.post(f"{base}/v1/encode/plan", json=body).json()
    assert answer["content_digest"] == content_digest(png_bytes())
    assert (answer["width"], answer["height"]) == (32, 24)
    assert tuple(answer["grid_thw"]) == planned_grid(model_dir, 32, 24)
    bad = httpx.post(f"{base}/v1/encode/plan", json={"url": 3})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request"
    missing = dict(body, url=f"{media_server.base}/nothing-here")
    answer = httpx.post(f"{base}/v1/encode/plan", json=missing)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "fetch_failed"
    assert metric(base, "mmserve_encoder_plan_requests_total", outcome="ok") >= 1


def test_a_planned_url_is_encoded_without_a_second_fetch(encoder, client, media_server):
    _, model_dir, port = encoder
    url = f"{media_server.base}/img.png"
    body = {"url": url, "min_pixels": 3136, "max_pixels": 16384}
    plan = httpx.post(f"http://127.0.0.1:{port}/v1/encode/plan", json=body).json()
    fetches = media_server.requests_seen.count("/img.png")
    item = bytes_item(
        model_dir,
        png_bytes(),
        identifier="planned",
        source="url",
        url=url,
        content_digest=plan["content_digest"],
        grid_thw=tuple(plan["grid_thw"]),
    )
    result, _ = client.encode(item)
    assert result.error_code is None
    assert media_server.requests_seen.count("/img.png") == fetches


@pytest.fixture(scope="module")
def secret_encoder(qwen2_vl_dir, tmp_path_factory) -> Iterator[int]:
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_text(SECRET.decode() + "\n")
    # a patch budget of 16: no two of the test images (16 patches or more) share a call
    flags = ("--encoder-secret-file", str(path), "--encoder-patch-budget", "16")
    config = encoder_config(qwen2_vl_dir, SECRET_PORT, *flags)
    with running_encoder(config):
        yield SECRET_PORT


def test_with_a_secret_only_signed_messages_and_bearer_requests_pass(
    secret_encoder, qwen2_vl_dir, media_server
):
    base = f"http://127.0.0.1:{secret_encoder}"
    data = png(32, 32, seed=14)
    unsigned = EncoderClient(secret_encoder + 1)
    wrong = EncoderClient(secret_encoder + 1, secret=b"not-it")
    signed = EncoderClient(secret_encoder + 1, secret=SECRET)
    try:
        unsigned.send(bytes_item(qwen2_vl_dir, data))
        wrong.send(Ping(1))
        result, _ = signed.encode(bytes_item(qwen2_vl_dir, data))
        assert result.error_code is None
        assert not unsigned.socket.poll(200) and not wrong.socket.poll(0)
    finally:
        for c in (unsigned, wrong, signed):
            c.close()
    assert metric(base, "mmserve_encoder_malformed_messages_total", reason="bad_mac") >= 2
    assert httpx.get(f"{base}/v1/encode/info").status_code == 401
    auth = {"Authorization": f"Bearer {SECRET.decode()}"}
    assert httpx.get(f"{base}/v1/encode/info", headers=auth).status_code == 200
    # no --allowed-media-domains here: a private address is refused, as `serve` refuses it
    body = {"url": f"{media_server.base}/img.png", "min_pixels": 3136, "max_pixels": 16384}
    refused = httpx.post(f"{base}/v1/encode/plan", json=body, headers=auth)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "fetch_refused"


def test_queued_patches_count_waiting_items_and_cancel_drops_them(encoder, client, media_server):
    _, model_dir, port = encoder
    slow = f"{media_server.base}/late-404"  # answers 404 after 0.3 s: the item waits on it
    item = bytes_item(model_dir, png_bytes(), identifier="slow", source="url", url=slow)
    client.send(item)
    client.send(Ping(1))
    pong, _ = client.recv()
    t, h, w = item.item.grid_thw
    assert isinstance(pong, Pong) and pong.queued_patches == t * h * w
    client.send(Cancel(["slow"], [0]))
    client.send(Ping(2))
    pong, _ = client.recv()
    assert isinstance(pong, Pong) and pong.queued_patches == 0
    assert not client.socket.poll(600)  # the cancelled item is never answered
    assert metric(f"http://127.0.0.1:{port}", "mmserve_encoder_items_cancelled_total") >= 1


def test_the_patch_budget_bounds_every_vision_call(secret_encoder, qwen2_vl_dir):
    base = f"http://127.0.0.1:{secret_encoder}"
    calls = metric(base, "mmserve_encoder_forward_calls_total")
    encoded = metric(base, "mmserve_encoder_items_encoded_total")
    client = EncoderClient(secret_encoder + 1, secret=SECRET)
    try:
        images = [png(56, 56 + 28 * i, seed=30 + i) for i in range(3)]
        for i, data in enumerate(images):
            client.send(bytes_item(qwen2_vl_dir, data, identifier=f"b{i}"))
        replies = [client.recv()[0] for _ in images]
    finally:
        client.close()
    assert all(isinstance(r, EncodeResult) and r.error_code is None for r in replies)
    assert metric(base, "mmserve_encoder_items_encoded_total") == encoded + 3
    assert metric(base, "mmserve_encoder_forward_calls_total") == calls + 3


def test_a_vision_tower_failure_is_an_internal_error_and_the_next_batch_runs(qwen2_vl_dir):
    """The encoder's own fault (the LM side retries elsewhere); the server goes on."""
    config = encoder_config(qwen2_vl_dir, 18116)
    with running_encoder(config) as server:
        real = server.vision.encode
        calls = []

        def fail_once(images):
            calls.append(len(images))
            if len(calls) == 1:
                raise RuntimeError("CUDA error: an illegal memory access (simulated)")
            return real(images)

        server.vision.encode = fail_once
        client = EncoderClient(18117)
        try:
            picture = png(56, 28, seed=31)
            result, payload = client.encode(bytes_item(qwen2_vl_dir, picture))
            assert result.error_code == "internal" and payload == b""
            assert "vision tower" in (result.error_message or "")
            result, payload = client.encode(bytes_item(qwen2_vl_dir, picture))
            assert result.error_code is None and not result.cache_hit
            assert len(payload) == result.shape[0] * result.shape[1] * 4
        finally:
            client.close()
    assert calls == [1, 1]
