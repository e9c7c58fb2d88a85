"""The batched bitmask application against a plain per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.execution.sample.bitmask import apply_token_bitmask_, sampling_bitmask
from mmserve.execution.sample.rows import SamplingRow
from mmserve.execution.sample.sampler import sample
from mmserve.sampling_params import SamplingParams
from mmserve.scheduling.outputs import GrammarOutput


def reference(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """Token by token: allowed iff its bit is set (no bit for it: disallowed)."""
    out = logits.clone()
    num_rows, vocab = logits.shape
    for r in range(num_rows):
        for t in range(vocab):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


def random_bitmask(rng: np.random.Generator, num_rows: int, num_words: int) -> np.ndarray:
    words = rng.integers(-(2**31), 2**31, (num_rows, num_words), dtype=np.int64)
    words[0] = -1  # a row without a grammar
    if num_rows > 2:
        words[2] = 0  # a row that allows nothing
        words[1, : num_words // 2] = np.int32(-(2**31))  # only the sign bit
    return words.astype(np.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 97, 576, 1001])
@pytest.mark.parametrize("extra_words", [-1, 0, 1])
def test_matches_the_reference_on_odd_vocab_sizes(vocab, extra_words):
    rng = np.random.default_rng(vocab * 7 + extra_words)
    num_words = max(1, (vocab + 31) // 32 + extra_words)  # narrower, exact, wider
    bitmask = random_bitmask(rng, 4, num_words)
    logits = torch.from_numpy(rng.standard_normal((4, vocab)).astype(np.float32))
    expected = reference(logits, bitmask)
    apply_token_bitmask_(logits, torch.from_numpy(bitmask))
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_an_all_ones_row_changes_nothing_and_bf16_works():
    logits = torch.randn(2, 70, dtype=torch.bfloat16)
    before = logits.clone()
    bitmask = torch.full((2, 3), -1, dtype=torch.int32)
    bitmask[1, 0] = 0b101  # tokens 0 and 2 only, in the first word
    bitmask[1, 1:] = 0
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits[0], before[0])
    allowed = torch.isfinite(logits[1]).nonzero().view(-1).tolist()
    assert allowed == [0, 2]


def test_the_sampler_never_picks_a_disallowed_token():
    generator = torch.Generator().manual_seed(0)
    vocab = 100
    logits = torch.randn(3, vocab)
    logits[:, 50] = 100.0  # the favourite, disallowed below for rows 1 and 2
    bitmask = torch.full((3, 4), -1, dtype=torch.int32)
    bitmask[1] = torch.tensor([0, 1 << 9, 0, 0], dtype=torch.int32)  # only token 41
    bitmask[2] = torch.tensor([0b110, 0, 0, 0], dtype=torch.int32)  # tokens 1 and 2
    rows = [
        SamplingRow("greedy", SamplingParams(temperature=0), 0, ()),
        SamplingRow("one", SamplingParams(temperature=0), 0, ()),
        SamplingRow("sampled", SamplingParams(temperature=5.0), 0, ()),
    ]
    picks = [sample(logits.clone(), rows, generator, token_bitmask=bitmask) for _ in range(30)]
    assert {p[0] for p in picks} == {50}
    assert {p[1] for p in picks} == {41}
    assert {p[2] for p in picks} <= {1, 2}


def test_sampling_rows_take_their_grammar_row_and_others_all_ones():
    grammar = GrammarOutput(("b", "d"), np.array([[1, 2], [3, 4]], dtype=np.int32))
    rows = sampling_bitmask(grammar, ["a", "d", "b", "c"])
    assert rows.tolist() == [[-1, -1], [3, 4], [1, 2], [-1, -1]]
    assert sampling_bitmask(grammar, ["a", "c"]) is None
    assert sampling_bitmask(None, ["a"]) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_mask_is_applied_on_the_device_as_on_the_cpu():
    rng = np.random.default_rng(1)
    vocab = 151_936  # Qwen2-VL's padded logits width
    bitmask = random_bitmask(rng, 8, (vocab + 31) // 32)
    logits = torch.from_numpy(rng.standard_normal((8, vocab)).astype(np.float32))
    on_device = logits.to("cuda", torch.bfloat16)
    apply_token_bitmask_(on_device, torch.from_numpy(bitmask))  # the mask comes from the host
    apply_token_bitmask_(logits, torch.from_numpy(bitmask))
    assert on_device.device.type == "cuda"
    assert torch.equal(torch.isinf(on_device.cpu()), torch.isinf(logits))
