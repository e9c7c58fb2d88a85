"""StructuredOutputParams and the compiler: what is refused, with which message and field."""

from __future__ import annotations

import json

import pytest

from mmserve.errors import InvalidRequestError
from mmserve.sampling_params import SamplingParams
from mmserve.structured_output.compiler import check_structured_output
from mmserve.structured_output.params import MAX_SPEC_CHARS, StructuredOutputParams
from tests.support.grammar import toy_compiler


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: StructuredOutputParams("yaml", "x"), "kind must be one of"),
        (lambda: StructuredOutputParams("regex", ""), "must not be empty"),
        (lambda: StructuredOutputParams("regex", 5), "must be a string"),
        (lambda: StructuredOutputParams("json_object", "{}"), "takes no spec"),
        (lambda: StructuredOutputParams.json("{nope"), "not valid JSON"),
        (lambda: StructuredOutputParams.json("[1, 2]"), "must be a JSON object"),
        (lambda: StructuredOutputParams.choice([]), "list of 1 to"),
        (lambda: StructuredOutputParams.choice(["a", ""]), "non-empty strings"),
        (lambda: StructuredOutputParams.choice("ab"), "list of strings"),
        (lambda: StructuredOutputParams("grammar", "x" * (MAX_SPEC_CHARS + 1)), "at most"),
        (lambda: SamplingParams(structured_outputs={"json": {}}), "StructuredOutputParams"),
    ],
)
def test_malformed_specs_are_refused_naming_structured_outputs(build, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        build()
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize(
    "params, match",
    [
        (StructuredOutputParams.json({"type": "bogus"}), "invalid JSON schema.*bogus"),
        (StructuredOutputParams.json({"type": "string", "pattern": "a(b"}), "JSON schema"),
        (StructuredOutputParams.regex("a(b"), "invalid regex.*unclosed group"),
        (StructuredOutputParams.grammar("start: foo"), "invalid grammar.*foo"),
        (StructuredOutputParams.grammar('root ::= ( "a"'), "invalid grammar"),
    ],
)
def test_specs_that_do_not_compile_are_refused_with_the_compilers_message(params, match):
    match = "(?s)" + match  # the compiler's messages span lines (a caret under the fault)
    with pytest.raises(InvalidRequestError, match=match) as info:
        check_structured_output(params, param="guided_json")
    assert info.value.param == "guided_json"
    with pytest.raises(InvalidRequestError, match=match):
        toy_compiler().make_matcher(params)


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputParams.json({"type": "object", "properties": {"a": {"type": "boolean"}}}),
        StructuredOutputParams.json_object(),
        StructuredOutputParams.regex(r"[0-9]+"),
        StructuredOutputParams.choice(['say "hi"', "a\\b", "ünï"]),
        StructuredOutputParams.grammar('start: "yes" | "no"'),
        StructuredOutputParams.grammar('root ::= "yes" | "no"'),  # vLLM's EBNF / GBNF
    ],
)
def test_valid_specs_compile(params):
    check_structured_output(params)
    assert not toy_compiler().make_matcher(params).is_error()


def test_a_choice_accepts_exactly_its_strings():
    compiler = toy_compiler()
    choices = ['say "hi"', "a\\b"]
    tok = compiler.tokenizer
    for text in choices:
        matcher = compiler.make_matcher(StructuredOutputParams.choice(choices))
        assert matcher.consume_tokens(tok.tokenize_str(text)), text
        assert matcher.is_stopped()
    matcher = compiler.make_matcher(StructuredOutputParams.choice(choices))
    assert not matcher.consume_tokens(tok.tokenize_str("say hi"))


def test_json_has_no_free_whitespace_so_output_is_bounded():
    compiler = toy_compiler()
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    matcher = compiler.make_matcher(StructuredOutputParams.json(schema))
    assert not matcher.consume_tokens(compiler.tokenizer.tokenize_str("{ "))
    matcher = compiler.make_matcher(StructuredOutputParams.json(schema))
    assert matcher.consume_tokens(compiler.tokenizer.tokenize_str('{"a":true}'))
    assert matcher.is_accepting()
    assert json.loads('{"a":true}') == {"a": True}


def test_compiled_grammars_are_cached_with_a_bound_and_each_request_gets_its_own_matcher():
    compiler = toy_compiler(max_cached=2)
    first = compiler.make_matcher(StructuredOutputParams.regex("ab"))
    second = compiler.make_matcher(StructuredOutputParams.regex("ab"))
    assert compiler.num_cached == 1
    assert first.consume_token(compiler.tokenizer.tokenize_str("a")[0])
    # the second copy did not move with the first
    assert second.consume_tokens(compiler.tokenizer.tokenize_str("ab"))
    for pattern in ("x", "y", "z"):
        compiler.make_matcher(StructuredOutputParams.regex(pattern))
    assert compiler.num_cached == 2
