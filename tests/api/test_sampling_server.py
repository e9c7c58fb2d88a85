"""n, logprobs, penalties and logit_bias through the `openai` client against a real server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer

from tests.support.factory import write_tiny_checkpoint
from tests.support.harness import Server, wait_until_idle
from tests.support.oracle import HFOracle
from tests.support.parity_cases import DIVERSE

MAX_LOGPROBS = 6
PROMPT_IDS = [21, 34, 55, 89, 144, 233, 17, 4]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("diverse"), "qwen2_vl", seed=5, **DIVERSE)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = Server(checkpoint, log, "--max-logprobs", str(MAX_LOGPROBS))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    return server.client.models.list().data[0].id


def _reference(checkpoint: Path, prompt_ids: list[int], num_tokens: int) -> torch.Tensor:
    """transformers' greedy continuation's log-softmax: [num_tokens, vocab]."""
    oracle = HFOracle(checkpoint)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = oracle.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def test_completion_logprobs_equal_transformers_streamed_or_not(server, model, checkpoint):
    num_tokens, k = 6, 4
    reference = _reference(checkpoint, PROMPT_IDS, num_tokens)
    kwargs = dict(model=model, prompt=PROMPT_IDS, max_tokens=num_tokens, temperature=0)
    resp = server.client.completions.create(logprobs=k, extra_body={"ignore_eos": True}, **kwargs)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_tokens
    for step, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        best = reference[step].topk(k)
        assert abs(value - float(best.values[0])) < 1e-4  # greedy: the sampled token is the top
        # {text: logprob}: distinct ids that decode to one text (a partial UTF-8 byte) share
        # an entry, so each value must be one of the reference's top k
        assert 0 < len(top) <= k
        for got in top.values():
            assert float((best.values - got).abs().min()) < 1e-4
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(num_tokens)]

    stream = server.client.completions.create(
        logprobs=k, stream=True, extra_body={"ignore_eos": True}, **kwargs
    )
    streamed = [
        v for c in stream for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_shape_and_stream(server, model):
    messages = [{"role": "user", "content": "Say something."}]
    kwargs = dict(model=model, messages=messages, max_tokens=5, temperature=0.9, seed=3)
    resp = server.client.chat.completions.create(logprobs=True, top_logprobs=3, **kwargs)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True) and item.logprob <= values[0] + 1e-6
    stream = server.client.chat.completions.create(
        logprobs=True, top_logprobs=3, stream=True, **kwargs
    )
    streamed = [t for c in stream for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    plain = server.client.chat.completions.create(**kwargs)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == resp.choices[0].message.content


def test_n_three_choices_reproducible_with_a_seed(server, model):
    messages = [{"role": "user", "content": "Tell me a story."}]
    kwargs = dict(
        model=model,
        messages=messages,
        max_tokens=6,
        temperature=1.5,
        seed=42,
        n=3,
        extra_body={"ignore_eos": True},
    )
    first = server.client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1
    again = server.client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == texts
    single = server.client.chat.completions.create(**{**kwargs, "n": 1, "seed": 43})
    assert single.choices[0].message.content == texts[1]  # sample i uses seed + i
    assert first.usage.completion_tokens == 3 * 6  # summed over the choices
    assert [c.finish_reason for c in first.choices] == ["length"] * 3

    stream = server.client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    streamed = {i: "" for i in range(3)}
    finishes = []
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes.append(choice.index)
    assert sorted(finishes) == [0, 1, 2]
    assert [streamed[i] for i in range(3)] == texts
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        first.usage.completion_tokens
    )

    comp = server.client.completions.create(model=model, prompt="Once", max_tokens=4, n=2, seed=1)
    assert [c.index for c in comp.choices] == [0, 1]


def test_a_strong_logit_bias_forces_a_token_and_penalties_change_the_answer(
    server, model, checkpoint
):
    token = 300
    kwargs = dict(model=model, prompt=PROMPT_IDS, max_tokens=5, temperature=1.0, logprobs=0)
    resp = server.client.completions.create(
        logit_bias={str(token): 100}, extra_body={"ignore_eos": True}, **kwargs
    )
    lp = resp.choices[0].logprobs
    text = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).decode([token], False)
    assert lp.tokens == [text] * 5
    greedy = dict(model=model, prompt=PROMPT_IDS, max_tokens=8, temperature=0)
    plain = server.client.completions.create(extra_body={"ignore_eos": True}, **greedy)
    penalized = server.client.completions.create(
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.5},
        **greedy,
    )
    assert penalized.choices[0].text != plain.choices[0].text


def test_limits_are_400s_naming_the_field_and_the_flag(server, model):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        server.client.chat.completions.create(
            model=model, messages=messages, logprobs=True, top_logprobs=MAX_LOGPROBS + 1
        )
    assert info.value.body["param"] == "top_logprobs" and "--max-logprobs" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        server.client.completions.create(model=model, prompt="hi", logprobs=MAX_LOGPROBS + 1)
    assert info.value.body["param"] == "logprobs"
    for bias in ({"abc": 1}, {str(10**9): 1}):
        with pytest.raises(openai.BadRequestError) as info:
            server.client.completions.create(model=model, prompt="hi", logit_bias=bias)
        assert info.value.body["param"] == "logit_bias"
    ok = server.client.chat.completions.create(
        model=model, messages=messages, logprobs=True, top_logprobs=MAX_LOGPROBS, max_tokens=1
    )
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == MAX_LOGPROBS


def test_a_client_gone_mid_stream_aborts_every_sample(server, model):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Go on and on."}],
        "max_tokens": 200,
        "n": 3,
        "stream": True,
        "ignore_eos": True,
    }
    before = wait_until_idle(server.url)["mmserve_generation_tokens_total"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content": "' in line:
                break  # leave with every sample still running
    m = wait_until_idle(server.url)  # every KV block and encoder slot free again
    assert m["mmserve_generation_tokens_total"] - before < 3 * 200  # stopped, all three
