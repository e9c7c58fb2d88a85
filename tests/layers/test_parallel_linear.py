"""The parallel layers on two gloo ranks equal the plain layers (float32), and are the plain
layers' exact op on one rank; which heads a rank holds, and the sizes refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve.layers.parallel import (
    SINGLE,
    ColumnParallelLinear,
    HeadSplit,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    copy_weight_part,
    split_heads,
    vocab_parallel_logits,
)
from tests.support.distributed import run_ranks

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 16, 4, 2, 4, 24, 11


def _checkpoint() -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors as a checkpoint names them."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "q_proj.weight": randn(HEADS * HEAD_DIM, HIDDEN),
        "q_proj.bias": randn(HEADS * HEAD_DIM),
        "k_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
        "k_proj.bias": randn(KV_HEADS * HEAD_DIM),
        "v_proj.weight": randn(KV_HEADS * HEAD_DIM, HIDDEN),
        "v_proj.bias": randn(KV_HEADS * HEAD_DIM),
        "o_proj.weight": randn(HIDDEN, HEADS * HEAD_DIM),
        "o_proj.bias": randn(HIDDEN),
        "gate_proj.weight": randn(INTER, HIDDEN),
        "up_proj.weight": randn(INTER, HIDDEN),
        "down_proj.weight": randn(HIDDEN, INTER),
        "qkv.weight": randn(3 * HIDDEN, HIDDEN),  # a ViT's stacked [q|k|v]
        "qkv.bias": randn(3 * HIDDEN),
        "embed.weight": randn(VOCAB, HIDDEN),
        "x": randn(5, HIDDEN),
    }


def _fill(module: torch.nn.Module, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Load `module` (named `name` beside the checkpoint's tensors) from its weight parts, as
    the loader does from the files."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for param in params.values():
            param.zero_()
        for part in module.weight_parts():
            source = part.source or f"{name}.{part.param}"
            full = tensors[source]
            assert tuple(full.shape) == part.full_shape
            copy_weight_part(params[part.param], part, lambda index, full=full: full[index])


def _layers(group: TPGroup) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (parallel output, plain output) on this rank."""
    t = _checkpoint()
    x = t["x"]
    heads = split_heads(HEADS, KV_HEADS, group)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    qkv = ColumnParallelLinear.qkv(
        HIDDEN,
        HEAD_DIM,
        heads,
        (HEADS, KV_HEADS),
        ("q_proj", "k_proj", "v_proj"),
        bias=True,
        tp=group,
    )
    _fill(qkv, "qkv_proj", t)
    q, k, v = qkv(x).split(qkv.output_sizes, dim=-1)
    q_rows = slice(heads.first_head * HEAD_DIM, (heads.first_head + heads.num_heads) * HEAD_DIM)
    kv_rows = slice(
        heads.first_kv_head * HEAD_DIM, (heads.first_kv_head + heads.num_kv_heads) * HEAD_DIM
    )
    out["q"] = q, F.linear(x, t["q_proj.weight"], t["q_proj.bias"])[:, q_rows]
    out["k"] = k, F.linear(x, t["k_proj.weight"], t["k_proj.bias"])[:, kv_rows]
    out["v"] = v, F.linear(x, t["v_proj.weight"], t["v_proj.bias"])[:, kv_rows]

    o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=True, tp=group, what="width")
    _fill(o_proj, "o_proj", t)
    attn_full = F.linear(x, t["q_proj.weight"], t["q_proj.bias"])  # any [n, heads * head_dim]
    out["o_proj"] = (
        o_proj(attn_full[:, q_rows]),
        F.linear(attn_full, t["o_proj.weight"], t["o_proj.bias"]),
    )

    gate_up = ColumnParallelLinear.merged(
        HIDDEN, [INTER, INTER], ["gate_proj", "up_proj"], bias=False, tp=group, what="inter"
    )
    down = RowParallelLinear(INTER, HIDDEN, bias=False, tp=group, what="inter")
    _fill(gate_up, "gate_up_proj", t)
    _fill(down, "down_proj", t)
    gate, up = gate_up(x).chunk(2, dim=-1)
    plain = F.silu(x @ t["gate_proj.weight"].t()) * (x @ t["up_proj.weight"].t())
    out["mlp"] = down(F.silu(gate) * up), plain @ t["down_proj.weight"].t()

    vit_qkv = ColumnParallelLinear.qkv(
        HIDDEN,
        HEAD_DIM,
        split_heads(HEADS, HEADS, group),
        (HEADS, HEADS),
        None,
        bias=True,
        tp=group,
    )
    _fill(vit_qkv, "qkv", t)
    full = F.linear(x, t["qkv.weight"], t["qkv.bias"]).view(5, 3, HEADS, HEAD_DIM)
    local_heads = HEADS // group.size
    mine = full[:, :, group.rank * local_heads : (group.rank + 1) * local_heads]
    out["vit_qkv"] = vit_qkv(x).view(5, 3, local_heads, HEAD_DIM), mine

    embed = VocabParallelEmbedding(VOCAB, HIDDEN, group)
    head = ParallelLMHead(VOCAB, HIDDEN, group)
    _fill(embed, "embed", t)
    _fill(head, "embed", t)
    ids = torch.tensor([0, 5, 6, 10, 3, 10, 1])  # both ends of both ranks' ranges
    out["embed"] = embed(ids), F.embedding(ids, t["embed.weight"])
    out["logits"] = vocab_parallel_logits(x, head), x @ t["embed.weight"].t()
    return out


def test_each_parallel_layer_equals_the_plain_layer_on_two_ranks() -> None:
    for rank, outputs in enumerate(run_ranks(_layers, 2)):
        for name, (parallel, plain) in outputs.items():
            assert parallel.shape == plain.shape, (rank, name)
            torch.testing.assert_close(parallel, plain, rtol=1e-5, atol=1e-5, msg=f"{rank} {name}")


def test_on_one_rank_the_layers_are_the_plain_ops() -> None:
    outputs = _layers(SINGLE)
    for name in ("o_proj", "vit_qkv", "embed", "logits"):  # the very op nn.Linear runs
        parallel, plain = outputs[name]
        assert torch.equal(parallel, plain), name
    # fused q/k/v and gate/up are one matmul where the plain layers run two or three: the same
    # dot products, summed in an order the BLAS picks per shape
    for name in ("q", "k", "v", "mlp"):
        parallel, plain = outputs[name]
        torch.testing.assert_close(parallel, plain, rtol=1e-6, atol=1e-5, msg=name)


def test_the_lm_head_pads_the_vocabulary_with_zero_rows() -> None:
    t = _checkpoint()
    group = TPGroup(rank=1, size=4, group=object())  # construction only: no collectives
    head = ParallelLMHead(VOCAB, HIDDEN, group)  # rows [3, 6)
    _fill(head, "embed", t)
    assert torch.equal(head.weight, t["embed.weight"][3:6])
    last = ParallelLMHead(VOCAB, HIDDEN, TPGroup(rank=3, size=4, group=object()))  # [9, 11) + pad
    with torch.no_grad():
        last.weight.fill_(float("nan"))
    _fill(last, "embed", t)
    assert torch.equal(last.weight[:2], t["embed.weight"][9:]) and not last.weight[2:].any()


def _group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank=rank, size=size, group=object() if size > 1 else None)


def test_kv_heads_are_split_or_replicated() -> None:
    assert split_heads(8, 2, _group(1, 2)) == HeadSplit(4, 4, 1, 1, 1)
    assert [split_heads(8, 2, _group(r, 4)) for r in range(4)] == [
        HeadSplit(2, 0, 1, 0, 2),
        HeadSplit(2, 2, 1, 0, 2),
        HeadSplit(2, 4, 1, 1, 2),
        HeadSplit(2, 6, 1, 1, 2),
    ]
    assert split_heads(8, 8, _group(0, 1)) == HeadSplit(8, 0, 8, 0, 1)


def test_impossible_head_counts_are_refused_naming_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"size 3 must divide the number of attention heads \(8\)"):
        split_heads(8, 2, _group(0, 3))
    with pytest.raises(ValueError, match=r"size 6 must divide the number of KV heads \(4\)"):
        split_heads(12, 4, _group(0, 6))
    with pytest.raises(ValueError, match=r"size 4 must divide the intermediate_size \(6\)"):
        RowParallelLinear(6, 4, bias=False, tp=_group(0, 4), what="intermediate_size")
