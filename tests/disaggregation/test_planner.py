"""HttpUrlPlanner against the fake encoder's HTTP routes and httpx's MockTransport."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mmserve.disaggregation.planner import HttpUrlPlanner
from mmserve.errors import ImageTooLargeError, InvalidRequestError, MediaFetchRefusedError
from mmserve.processing.url_planner import UrlPlan, UrlPlanUnavailable
from tests.support.fake_encoder import FakeEncoder

PLAN = {"content_digest": "d" * 64, "width": 640, "height": 480, "grid_thw": [1, 34, 46]}
UNREACHABLE = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def fake():
    encoder = FakeEncoder(secret=b"sesame")
    yield encoder
    encoder.close()


def plan(planner: HttpUrlPlanner, url: str = "https://img.example/a.png") -> UrlPlan:
    async def go() -> UrlPlan:
        try:
            return await planner.plan(url, min_pixels=3136, max_pixels=1003520)
        finally:
            await planner.aclose()

    return asyncio.run(go())


def test_a_plan_comes_back_typed_and_the_request_carries_the_secret(fake):
    fake.behaviour.plan, fake.behaviour.plan_status = PLAN, 200
    got = plan(HttpUrlPlanner([fake.url], secret=b"sesame", timeout_s=2))
    assert got == UrlPlan("d" * 64, 640, 480, (1, 34, 46))
    body, auth = fake.plan_requests[-1]
    assert body == {"url": "https://img.example/a.png", "min_pixels": 3136, "max_pixels": 1003520}
    assert auth == "Bearer sesame"


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("fetch_refused", MediaFetchRefusedError),
        ("image_too_large", ImageTooLargeError),
        ("something_new", InvalidRequestError),
    ],
)
def test_a_refusal_is_the_typed_error_a_local_fetch_raises(fake, code, error):
    message = "image host 'img.example' resolves to a private address"
    fake.behaviour.plan_status = 400
    fake.behaviour.plan = {"error": {"code": code, "message": message, "param": "image_url"}}
    with pytest.raises(error) as info:
        plan(HttpUrlPlanner([fake.url], secret=b"sesame", timeout_s=2))
    assert type(info.value) is error and info.value.message == message
    assert info.value.param == "image_url"


def test_a_dead_encoder_is_skipped_then_tried_last(fake, caplog):
    fake.behaviour.plan, fake.behaviour.plan_status = PLAN, 200
    planner = HttpUrlPlanner([UNREACHABLE, fake.url], secret=b"sesame", timeout_s=2)
    with caplog.at_level("WARNING", logger="mmserve.disaggregation.planner"):
        assert plan(planner).width == 640
        assert [r.getMessage().split()[1] for r in caplog.records] == [UNREACHABLE]
        for _ in range(3):  # its turn comes, but the healthy one goes first now
            assert plan(planner).width == 640
    assert len(caplog.records) == 1


def test_no_encoder_answering_is_unavailable_naming_each():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ReadTimeout("slow", request=request)
        return httpx.Response(200, json={"content_digest": "short"})  # not a plan

    planner = HttpUrlPlanner(
        ["http://a:1", "http://b:2"],
        secret=None,
        timeout_s=0.5,
        transport=httpx.MockTransport(handler),
    )
    with pytest.raises(UrlPlanUnavailable, match=r"http://a:1: ReadTimeout.*http://b:2: HTTP 200"):
        plan(planner)


def test_a_wrong_secret_is_not_the_clients_fault(fake):
    fake.behaviour.plan, fake.behaviour.plan_status = PLAN, 200
    with pytest.raises(UrlPlanUnavailable, match="HTTP 401"):
        plan(HttpUrlPlanner([fake.url], secret=b"wrong", timeout_s=2))
