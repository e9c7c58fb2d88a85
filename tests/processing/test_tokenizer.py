"""The chat template call: caller kwargs may add variables, never replace the renderer's own,
and a template that fails is the client's 400 in our words."""

from __future__ import annotations

import pytest
import tokenizers

from mmserve.config.model import bundled_toy_model_dir
from mmserve.errors import InvalidRequestError
from mmserve.processing.input_processor import InputProcessor
from mmserve.processing.tokenizer import RESERVED_TEMPLATE_ARGS, Tokenizer

IMAGE = {"type": "image_url", "image_url": {"url": "data:,"}}
IMAGE_MESSAGE = [{"role": "user", "content": [IMAGE, {"type": "text", "text": "hi"}]}]


def tiny_tokenizer(chat_template: str) -> Tokenizer:
    model = tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")
    return Tokenizer(tokenizers.Tokenizer(model), chat_template=chat_template)


@pytest.fixture(scope="module")
def toy_tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(bundled_toy_model_dir())


def test_caller_kwargs_reach_the_template(toy_tokenizer: Tokenizer) -> None:
    plain = toy_tokenizer.apply_chat_template(IMAGE_MESSAGE)
    numbered = toy_tokenizer.apply_chat_template(
        IMAGE_MESSAGE, template_kwargs={"add_vision_id": True}
    )
    assert "Picture 1:" in numbered and "Picture 1:" not in plain


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_ARGS))
def test_kwargs_may_not_set_what_the_renderer_passes(toy_tokenizer: Tokenizer, key: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        toy_tokenizer.apply_chat_template(IMAGE_MESSAGE, template_kwargs={key: "x"})
    assert info.value.param == f"chat_template_kwargs.{key}"
    assert repr(key) in info.value.message


def test_kwargs_must_be_plain_json_data(toy_tokenizer: Tokenizer) -> None:
    for value in (object(), {"nested": [b"bytes"]}, {1: "non-string key"}):
        with pytest.raises(InvalidRequestError) as info:
            toy_tokenizer.apply_chat_template(IMAGE_MESSAGE, template_kwargs={"v": value})
        assert info.value.param == "chat_template_kwargs.v"
    ok = {"v": [None, True, 1, 2.5, "s", {"k": []}]}
    assert toy_tokenizer.apply_chat_template(IMAGE_MESSAGE, template_kwargs=ok)


def test_a_template_that_raises_on_caller_kwargs_is_a_400_in_our_words() -> None:
    tok = tiny_tokenizer("{{ messages[0]['content'] ~ (count + 1) }}")
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], template_kwargs={"count": 1})
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template([{"role": "user", "content": "a"}], template_kwargs={"count": "x"})
    message = info.value.message
    assert message.startswith("chat template failed")
    assert info.value.param == "chat_template_kwargs" and "count" in message
    assert "concatenate" not in message  # no library text
    with pytest.raises(InvalidRequestError) as info:
        tiny_tokenizer("{{ messages[5] + 1 }}").apply_chat_template([{"role": "user"}])
    assert info.value.param == "messages"


def test_the_input_processor_passes_kwargs_through_the_same_check() -> None:
    processor = InputProcessor.from_pretrained(bundled_toy_model_dir(), max_model_len=4096)
    messages = [{"role": "user", "content": "hi"}]
    # Before: `**kwargs` next to add_generation_prompt=... raised TypeError (a 500).
    with pytest.raises(InvalidRequestError) as info:
        processor.render_chat_parts(messages, chat_template_kwargs={"add_generation_prompt": False})
    assert info.value.param == "chat_template_kwargs.add_generation_prompt"
    prompt, _ = processor.render_chat_parts(messages, chat_template_kwargs={"add_vision_id": True})
    assert prompt.endswith("<|im_start|>assistant\n")


CONTINUED = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": [{"type": "text", "text": "It is "}]},
]


def test_continue_final_message_ends_at_the_last_message_text(toy_tokenizer: Tokenizer) -> None:
    closed = toy_tokenizer.apply_chat_template(CONTINUED, add_generation_prompt=False)
    continued = toy_tokenizer.apply_chat_template(
        CONTINUED, add_generation_prompt=False, continue_final_message=True
    )
    assert closed.startswith(continued) and continued.endswith("<|im_start|>assistant\nIt is")
    assert closed[len(continued) :] == " <|im_end|>\n"  # what continuing leaves off
    for params, param in (
        ({"add_generation_prompt": True}, "continue_final_message"),
        ({"add_generation_prompt": False}, "continue_final_message"),
    ):
        messages = (
            CONTINUED
            if params["add_generation_prompt"]
            else CONTINUED[:1] + [{"role": "assistant", "content": []}]
        )
        with pytest.raises(InvalidRequestError) as info:
            toy_tokenizer.apply_chat_template(messages, continue_final_message=True, **params)
        assert info.value.param == param


def test_a_request_chat_template_renders_in_the_sandbox(toy_tokenizer: Tokenizer) -> None:
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    assert toy_tokenizer.apply_chat_template(messages, chat_template=own) == "[user] hi\n"
    assert "<|im_start|>" in toy_tokenizer.apply_chat_template(messages)  # the model's, still
    for bad in (
        "{% for %}",  # does not compile
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox refuses it
        "{{ x }}" * 20_000,  # too long
    ):
        with pytest.raises(InvalidRequestError) as info:
            toy_tokenizer.apply_chat_template(messages, chat_template=bad)
        assert info.value.param == "chat_template"


def test_encode_adds_special_tokens_only_when_asked() -> None:
    model = tokenizers.models.WordLevel({"a": 0, "[UNK]": 1, "<s>": 2}, unk_token="[UNK]")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 2)]
    )
    tok = Tokenizer(raw)
    assert tok.encode("a a") == [0, 0]
    assert tok.encode("a a", add_special_tokens=True) == [2, 0, 0]
