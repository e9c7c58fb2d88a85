"""Chat parsing: image parts in order, and caller UUIDs that are short, printable names."""

from __future__ import annotations

import pytest

from mmserve.errors import InvalidRequestError
from mmserve.processing.chat import MAX_UUID_CHARS, check_media_uuid, parse_chat_messages


def _image_message(image_url: dict, **part: object) -> list[dict]:
    parts = [{"type": "image_url", "image_url": image_url, **part}, {"type": "text", "text": "?"}]
    return [{"role": "user", "content": parts}]


def test_uuids_are_collected_from_image_url_or_the_part() -> None:
    parsed = parse_chat_messages(
        _image_message({"url": "data:,", "uuid": "a" * MAX_UUID_CHARS}), ()
    )
    assert parsed.uuids == ["a" * MAX_UUID_CHARS]
    assert parse_chat_messages(_image_message({"url": "data:,"}, uuid="logo é"), ()).uuids == [
        "logo é"
    ]


@pytest.mark.parametrize(
    ("uuid", "why"),
    [
        ("x" * (MAX_UUID_CHARS + 1), "at most 256"),
        ("x" * (1 << 20), "at most 256"),
        ("", "non-empty string"),
        (7, "non-empty string, got int"),
        (["a"], "non-empty string, got list"),
        ("line\nbreak", "printable"),
        ("nul\x00", "printable"),
        ("lone \ud800 surrogate", "printable"),
    ],
)
def test_bad_uuids_are_a_400_naming_the_field(uuid: object, why: str) -> None:
    with pytest.raises(InvalidRequestError, match=why) as info:
        parse_chat_messages(_image_message({"url": "data:,", "uuid": uuid}), ())
    assert info.value.param == "messages"
    assert "messages[0].content[0].image_url.uuid" in info.value.message
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].content\[0\].uuid"):
        parse_chat_messages(_image_message({"url": "data:,"}, uuid=uuid), ())


def test_check_media_uuid_names_the_param_it_is_given() -> None:
    assert check_media_uuid("ok", "x", "multi_modal_uuids") == "ok"
    with pytest.raises(InvalidRequestError) as info:
        check_media_uuid("y" * 300, "multi_modal_uuids.image[2]", "multi_modal_uuids")
    assert info.value.param == "multi_modal_uuids"
    assert info.value.message.startswith("multi_modal_uuids.image[2] is 300 characters")
