"""vLLM's request fields end to end, with the openai client against `mmserve serve`: min_p,
allowed_token_ids, bad_words, prompt_logprobs (against transformers), echo, return_token_ids,
add_generation_prompt and continue_final_message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from mmserve.processing.tokenizer import Tokenizer
from tests.support.factory import write_tiny_checkpoint
from tests.support.harness import Server
from tests.support.oracle import HFOracle
from tests.support.parity_cases import DIVERSE

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fields"), "qwen2_vl", seed=3, **DIVERSE)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = Server(model_dir, log, "--max-num-batched-tokens", "16", "--block-size", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> HFOracle:
    return HFOracle(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def _complete(server: Server, **kwargs: Any) -> dict:
    extra = {
        k: kwargs.pop(k)
        for k in list(kwargs)
        if k not in ("max_tokens", "temperature", "seed", "logprobs", "echo")
    }
    resp = server.client.completions.create(
        model=server.client.models.list().data[0].id, prompt=PROMPT, extra_body=extra, **kwargs
    )
    return resp.model_dump()


def _chat(server: Server, messages: list[dict], **extra: Any) -> dict:
    resp = server.client.chat.completions.create(
        model=server.client.models.list().data[0].id,
        messages=messages,
        temperature=extra.pop("temperature", 0),
        max_tokens=extra.pop("max_tokens", 6),
        extra_body=extra,
    )
    return resp.model_dump()


def test_min_p_one_equals_greedy(server: Server) -> None:
    greedy = _complete(server, **GREEDY, return_token_ids=True)["choices"][0]["token_ids"]
    for seed in range(4):
        out = _complete(server, temperature=1.5, seed=seed, max_tokens=8, min_p=1.0,
                        return_token_ids=True)  # fmt: skip
        assert out["choices"][0]["token_ids"] == greedy


def test_allowed_token_ids_bound_every_token(server: Server, tokenizer: Tokenizer) -> None:
    allowed = [tokenizer.encode(w)[0] for w in (" cat", " dog", " red", " blue")]
    for seed in range(3):
        out = _complete(server, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True,
                        allowed_token_ids=allowed, return_token_ids=True)  # fmt: skip
        ids = out["choices"][0]["token_ids"]
        assert len(ids) == 8 and set(ids) <= set(allowed)


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_never_appear_as_any_of_their_tokenizations(
    server: Server, tokenizer: Tokenizer
) -> None:
    # allowed ids keep a tiny random model to whole words, so that a bad word is one it writes:
    # " w" tokens whose word is one token without the space too (both variants are banned)
    allowed = [i for i in range(tokenizer.vocab_size) if _is_word_token(tokenizer, i)][:4]
    assert len(allowed) == 4
    fields = {"allowed_token_ids": allowed, "ignore_eos": True}
    ids = _complete(server, **GREEDY, **fields, return_token_ids=True)["choices"][0]["token_ids"]
    word = tokenizer.decode(ids[:2]).strip()  # two words, e.g. "dog red": two tokens
    variants = [tokenizer.encode(word), tokenizer.encode(" " + word)]
    assert ids[:2] in variants, (word, variants)
    out = _complete(server, **GREEDY, **fields, bad_words=[word], return_token_ids=True)
    banned = out["choices"][0]["token_ids"]
    assert banned[0] == ids[0] and banned[1] != ids[1]  # the first token alone is fine
    for seq in variants:
        assert not _contains(banned, seq)
    single = tokenizer.decode(ids[:1]).strip()  # e.g. "dog": " dog" is banned too
    out = _complete(server, **GREEDY, **fields, bad_words=[single], return_token_ids=True)
    assert ids[0] not in out["choices"][0]["token_ids"]


def _is_word_token(tokenizer: Tokenizer, token_id: int) -> bool:
    text = tokenizer.decode([token_id])
    return (
        text.startswith(" ")
        and text[1:].isalpha()
        and tokenizer.encode(text) == [token_id]
        and len(tokenizer.encode(text[1:])) == 1
    )


def _reference(oracle: HFOracle, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = oracle.model(input_ids=torch.tensor([ids])).logits[0]  # [num_prompt, vocab]
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def _check_prompt_logprobs(entries: list, ids: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        values = {int(t): v for t, v in entry.items()}
        assert ids[p + 1] in values and len(values) in (k, k + 1)
        assert set(torch.topk(reference[p], k).indices.tolist()) <= set(values)
        for tid, v in values.items():
            assert abs(v["logprob"] - float(reference[p, tid])) < 1e-4
            assert isinstance(v["decoded_token"], str) and v["rank"] >= 1


def test_prompt_logprobs_match_transformers_on_completions_and_chat(
    server: Server, oracle: HFOracle
) -> None:
    out = _complete(server, **GREEDY, prompt_logprobs=3, return_token_ids=True)
    choice = out["choices"][0]
    ids = choice["prompt_token_ids"]
    _check_prompt_logprobs(choice["prompt_logprobs"], ids, _reference(oracle, ids), 3)
    messages = [{"role": "user", "content": PROMPT}]
    chat = _chat(server, messages, prompt_logprobs=2, return_token_ids=True)
    ids = chat["prompt_token_ids"]
    _check_prompt_logprobs(chat["prompt_logprobs"], ids, _reference(oracle, ids), 2)
    with pytest.raises(openai.BadRequestError) as info:
        server.client.chat.completions.create(
            model=server.client.models.list().data[0].id, messages=messages, stream=True,
            extra_body={"prompt_logprobs": 1},
        )  # fmt: skip
    assert info.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_echo_prepends_the_prompt_streamed_and_not(server: Server) -> None:
    plain = _complete(server, **GREEDY)["choices"][0]["text"]
    echoed = _complete(server, **GREEDY, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain
    model = server.client.models.list().data[0].id
    stream = server.client.completions.create(
        model=model, prompt=PROMPT, stream=True, echo=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT + plain
    ids = _complete(server, **GREEDY, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    from_ids = server.client.completions.create(model=model, prompt=ids, echo=True, **GREEDY)
    assert from_ids.choices[0].text == PROMPT + plain  # a token prompt echoes its text
    with_logprobs = _complete(server, **GREEDY, echo=True, logprobs=2, return_token_ids=True)
    choice = with_logprobs["choices"][0]
    lp = choice["logprobs"]
    num_prompt = len(choice["prompt_token_ids"])
    assert len(lp["tokens"]) == num_prompt + len(choice["token_ids"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][:num_prompt]) == PROMPT and choice["text"].startswith(PROMPT)
    assert lp["text_offset"][num_prompt] == len(PROMPT)


def test_return_token_ids_streamed_and_not(server: Server, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    whole = _chat(server, messages, return_token_ids=True)
    token_ids = whole["choices"][0]["token_ids"]
    # the text holds back a trailing partial UTF-8 character (a random model writes those)
    assert tokenizer.decode(token_ids).startswith(whole["choices"][0]["message"]["content"])
    assert len(token_ids) == whole["usage"]["completion_tokens"]
    assert whole["usage"]["prompt_tokens"] == len(whole["prompt_token_ids"])
    stream = server.client.chat.completions.create(
        model=server.client.models.list().data[0].id, messages=messages, stream=True,
        temperature=0, max_tokens=6, extra_body={"return_token_ids": True},
    )  # fmt: skip
    chunks = [c.model_dump() for c in stream]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    assert streamed == token_ids


def test_continue_final_message_and_no_generation_prompt(
    server: Server, tokenizer: Tokenizer
) -> None:
    start = "The answer is"
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": start}]
    cont = _chat(server, messages, continue_final_message=True, add_generation_prompt=False,
                 return_token_ids=True)  # fmt: skip
    assert cont["choices"][0]["message"]["role"] == "assistant"
    ids = cont["prompt_token_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n" + start
    )
    closed = _chat(server, messages, add_generation_prompt=False, return_token_ids=True)
    text = tokenizer.decode(closed["prompt_token_ids"], skip_special_tokens=False)
    assert text.endswith(start + "<|im_end|>\n")
    default = _chat(server, messages[:1], return_token_ids=True)
    no_prompt = _chat(server, messages[:1], add_generation_prompt=False, return_token_ids=True)
    assert no_prompt["choices"][0]["message"]["role"] == "user"  # vLLM's: the last message's
    suffix = tokenizer.encode("<|im_start|>assistant\n")
    assert default["prompt_token_ids"] == no_prompt["prompt_token_ids"] + suffix
    for both in ({"add_generation_prompt": True}, {}):  # true is its default, as in vLLM
        with pytest.raises(openai.BadRequestError) as info:
            _chat(server, messages, continue_final_message=True, **both)
        assert info.value.body["param"] == "continue_final_message"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"bad_words": ["x" * 2000]}, "bad_words"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
    ],
)
def test_bad_values_are_400s_naming_the_field(server: Server, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(server, [{"role": "user", "content": "hi"}], **extra)
    assert info.value.body["param"] == param  # type: ignore[index]


def test_a_request_chat_template_needs_the_trust_flag(
    model_dir: Path, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    own = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    log = tmp_path_factory.mktemp("trusted") / "server.log"
    srv = Server(model_dir, log, "--trust-request-chat-template")
    try:
        out = _chat(srv, [{"role": "user", "content": "hi"}], chat_template=own,
                    return_token_ids=True)  # fmt: skip
        assert out["prompt_token_ids"] == tokenizer.encode("<user>hi")
        with pytest.raises(openai.BadRequestError) as info:
            _chat(srv, [{"role": "user", "content": "hi"}], chat_template="{% for %}")
        assert info.value.body["param"] == "chat_template"  # type: ignore[index]
    finally:
        srv.stop()
