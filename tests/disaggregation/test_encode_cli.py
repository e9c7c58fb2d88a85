"""`mmserve encode` as a process: start on a tiny checkpoint, encode over ZMQ exactly as the
local tower does, SIGTERM -> exit 0; and the command lines it refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from mmserve.disaggregation.encode_args import ENCODER_SECRET_ENV
from mmserve.disaggregation.protocol import Ping, Pong, model_fingerprint
from tests.disaggregation.encoder_harness import (
    EncoderClient,
    LocalTower,
    as_array,
    bytes_item,
    encoder_config,
    metric,
    png,
    wait_healthy,
)

PORT = 18120
SRC = str(Path(__import__("mmserve").__file__).resolve().parents[1])


def test_encode_process_serves_embeddings_and_exits_zero_on_sigterm(qwen2_5_vl_dir) -> None:
    env = {**os.environ, "PYTHONPATH": SRC, ENCODER_SECRET_ENV: ""}
    argv = ["encode", "--model", str(qwen2_5_vl_dir), "--port", str(PORT), "--device", "cpu"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmserve", *argv], stderr=subprocess.PIPE, text=True, env=env
    )
    base = f"http://127.0.0.1:{PORT}"
    try:
        wait_healthy(base)
        info = httpx.get(f"{base}/v1/encode/info", timeout=5).json()
        assert info["zmq_port"] == PORT + 1
        assert info["model_fingerprint"] == model_fingerprint(qwen2_5_vl_dir)
        client = EncoderClient(info["zmq_port"])
        try:
            data = png(72, 56, seed=21)
            result, payload = client.encode(bytes_item(qwen2_5_vl_dir, data))
            client.send(Ping(5))
            pong, _ = client.recv()
        finally:
            client.close()
        expected = LocalTower(qwen2_5_vl_dir).embed_bytes(data)  # decoded in worker processes
        np.testing.assert_array_equal(as_array(result, payload), expected)
        assert isinstance(pong, Pong) and pong.queued_patches == 0
        assert metric(base, "mmserve_encoder_sent_bytes_total") == len(payload)
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert returncode == 0, stderr


def test_a_non_loopback_bind_without_a_secret_is_refused(qwen2_vl_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="--encoder-secret-file"):
        encoder_config(qwen2_vl_dir, 18130, "--host", "0.0.0.0")
    secret = tmp_path / "secret"
    secret.write_text("s\n")
    config = encoder_config(
        qwen2_vl_dir, 18130, "--host", "0.0.0.0", "--encoder-secret-file", str(secret)
    )
    assert config.secret == b"s" and config.zmq_port == 18131
    from_env = encoder_config(
        qwen2_vl_dir, 18130, "--host", "0.0.0.0", environ={ENCODER_SECRET_ENV: "e"}
    )
    assert from_env.secret == b"e"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        encoder_config(qwen2_vl_dir, 18130, "--encoder-secret-file", str(empty))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--zmq-port", "18140"], "--zmq-port must differ"),
        (["--encoder-patch-budget", "0"], "--encoder-patch-budget must be positive"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout"),
    ],
)
def test_bad_flags_are_refused_by_name(qwen2_vl_dir, flags, message) -> None:
    with pytest.raises(ValueError, match=message):
        encoder_config(qwen2_vl_dir, 18140, *flags)


def test_the_cli_exits_2_naming_the_problem(tmp_path, capsys) -> None:
    from mmserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["encode", "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no config.json" in capsys.readouterr().err


def test_help_lists_the_encoder_and_the_shared_media_flags(capsys) -> None:
    from mmserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["encode", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--zmq-port", "--encoder-cache-gb", "--encoder-secret-file"):
        assert flag in out
    for flag in ("--allowed-media-domains", "--max-media-bytes", "--max-image-pixels"):
        assert flag in out  # the very definitions `serve` has
