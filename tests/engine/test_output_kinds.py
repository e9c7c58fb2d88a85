"""Output kinds: deltas add up to the cumulative answer, FINAL_ONLY sends one update."""

from __future__ import annotations

from pathlib import Path

from mmserve import LLM, SamplingParams
from mmserve.engine.frontend.outputs import OutputKind, RequestOutput


def _updates(llm: LLM, kind: OutputKind, params: SamplingParams) -> list[RequestOutput]:
    engine = llm.engine
    engine.add_request("r", engine.input_processor.process("Once upon a time"), params,
                       output_kind=kind)  # fmt: skip
    updates: list[RequestOutput] = []
    for _ in range(200):
        updates += engine.step()
        if updates and updates[-1].finished:
            return updates
    raise AssertionError("the request did not finish")


def test_deltas_add_up_to_the_cumulative_updates(qwen2_vl_dir: Path) -> None:
    llm = LLM(model=str(qwen2_vl_dir))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["zz"])
    cumulative = _updates(llm, OutputKind.CUMULATIVE, params)
    deltas = _updates(llm, OutputKind.DELTA, params)
    final = _updates(llm, OutputKind.FINAL_ONLY, params)
    assert len(deltas) == len(cumulative) > 1
    assert len(final) == 1
    whole = cumulative[-1].outputs[0]
    assert "".join(u.outputs[0].text for u in deltas) == whole.text
    assert [t for u in deltas for t in u.outputs[0].token_ids] == whole.token_ids
    for d, c in zip(deltas, cumulative, strict=True):
        # every kind counts the tokens so far, and carries this update's part in delta_*
        assert d.outputs[0].num_tokens == c.outputs[0].num_tokens == len(c.outputs[0].token_ids)
        assert d.outputs[0].delta_text == c.outputs[0].delta_text == d.outputs[0].text
    only = final[0].outputs[0]
    assert (only.text, only.token_ids, only.finish_reason) == (
        whole.text,
        whole.token_ids,
        whole.finish_reason,
    )


def test_prompt_logprobs_come_once_in_deltas_and_on_every_cumulative_update(
    qwen2_vl_dir: Path,
) -> None:
    llm = LLM(model=str(qwen2_vl_dir))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    num_prompt = len(llm.engine.input_processor.process("Once upon a time").prompt_token_ids)
    deltas = _updates(llm, OutputKind.DELTA, params)
    carrying = [u for u in deltas if u.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is deltas[0]
    entries = carrying[0].prompt_logprobs
    assert entries is not None and len(entries) == num_prompt and entries[0] is None
    cumulative = _updates(llm, OutputKind.CUMULATIVE, params)
    assert all(u.prompt_logprobs == entries for u in cumulative)
    assert _updates(llm, OutputKind.FINAL_ONLY, params)[0].prompt_logprobs == entries
