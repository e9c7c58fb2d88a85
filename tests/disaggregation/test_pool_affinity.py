"""Two language servers sharing two `mmserve encode` servers: one picture sent to both is
encoded once, in every one of 20 runs, however loaded the machine.

Deterministic by construction, not by luck:
- Both language servers rank the encoders alike for a picture (rendezvous hashing on its
  identity, `mmserve/routing.py`), and the first-ranked one encodes it; the second request
  is answered from that encoder's embedding cache, or, when both arrive together, joins the
  encode in flight (the encoder deduplicates by content).
- Load cannot move it: the bound passes an encoder over only when it carries more than
  `routing.AFFINITY_SLACK` (16,384) input patches beyond the least-loaded one; here at most two
  small pictures (tens of patches) are ever in flight, so no load figure, stale or fresh, can
  reach that, and an idle encoder is never passed over.
- Time cannot move it: `--encoder-timeout` is far beyond any encode of these pictures (a slow
  encode is waited for, never retried elsewhere), and an encoder leaves rotation for silence
  only when a ping that went out stays unanswered (a pause of a language server's own never
  counts). `--encoder-fallback fail`: a picture no encoder took fails loudly instead of being
  encoded locally out of sight.

Each run sends a fresh picture (so no earlier run's cache entry answers it), in either order
or both at once, to servers started once for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.disaggregation.harness import Encoder, metric_sum
from tests.support.factory import png_bytes
from tests.support.harness import Server, data_url, image_part, read_metrics, user

RUNS = 20
PATIENT_TIMEOUT_S = 600  # --encoder-timeout: no encode of these pictures comes near it
ENCODED = "mmserve_encoder_items_encoded_total"
RETRIES = "mmserve_remote_encoder_retries_total"


@pytest.fixture(scope="module")
def servers(qwen2_vl_dir: Path, tmp_path_factory) -> Iterator[tuple[list[Encoder], list[Server]]]:
    logs = tmp_path_factory.mktemp("affinity_logs")
    encoders = [Encoder(qwen2_vl_dir, logs / f"enc{i}.log") for i in range(2)]
    language: list[Server] = []
    with ThreadPoolExecutor(2) as pair:  # both language servers start (and stop) together
        try:
            for enc in encoders:
                enc.wait_ready()
            flags = ["--encoder-urls", *(e.url for e in encoders)]
            flags += ["--encoder-timeout", str(PATIENT_TIMEOUT_S), "--encoder-fallback", "fail"]
            started = [
                pair.submit(Server, qwen2_vl_dir, logs / f"lm{i}.log", *flags) for i in (0, 1)
            ]
            language += [f.result() for f in started if f.exception() is None]  # waits for both
            for f in started:
                if f.exception() is not None:
                    raise f.exception()
            yield encoders, language
        finally:
            list(pair.map(lambda srv: srv.stop(), [*language, *encoders]))


def _ask(server: Server, picture: bytes) -> str:
    out = server.client.chat.completions.create(
        model=server.client.models.list().data[0].id,
        messages=user(image_part(data_url(picture)), "What is it?"),
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].message.content


def _encoded(encoders: list[Encoder]) -> list[float]:
    return [metric_sum(e.metrics(), ENCODED) for e in encoders]


def test_one_picture_from_two_language_servers_is_encoded_once_every_run(servers) -> None:
    encoders, (lm0, lm1) = servers
    retries_before = [read_metrics(lm.url)[RETRIES] for lm in (lm0, lm1)]
    outcomes = []
    with ThreadPoolExecutor(2) as both:
        for run in range(RUNS):
            # fresh pixels and sizes every run: 56..140 px a side, a few dozen patches
            picture = png_bytes(56 + 28 * (run % 4), 56 + 28 * (run % 3), 1000 + run)
            before = _encoded(encoders)
            if run % 3 == 2:  # both at once: the second joins the first one's encode
                answers = list(both.map(lambda lm, p=picture: _ask(lm, p), (lm0, lm1)))
            else:  # one after the other, in either order: the second is a cache hit
                order = (lm0, lm1) if run % 3 == 0 else (lm1, lm0)
                answers = [_ask(lm, picture) for lm in order]
            grew = [a - b for a, b in zip(_encoded(encoders), before, strict=True)]
            outcomes.append((run, grew, answers[0] == answers[1]))
    retried = [
        read_metrics(lm.url)[RETRIES] - b for lm, b in zip((lm0, lm1), retries_before, strict=True)
    ]
    assert all(sum(grew) == 1 for _, grew, _ in outcomes), (outcomes, retried)
    assert all(same for _, _, same in outcomes), outcomes
    assert retried == [0, 0]
    # rendezvous hashing spreads the pictures: both encoders took some (20 fresh pictures)
    assert all(sum(g[i] for _, g, _ in outcomes) > 0 for i in range(2)), outcomes
