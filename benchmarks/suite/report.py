"""The suite's JSON as a Markdown section for benchmarks/RESULTS.md (date, commit, goals)."""

from __future__ import annotations

import datetime
from typing import Any


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v, digits)}" for k, v in value.items())
    return "-" if value is None else str(value)


def _ok(results: dict[str, Any], name: str) -> dict[str, Any] | None:
    entry = results["sections"].get(name, {})
    return entry.get("result") if entry.get("status") == "ok" else None


def _goal_lines(results: dict[str, Any]) -> list[str]:
    lines = ["| goal | value | met |", "|---|---|---|"]
    for goal in results["summary"]["goals"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[goal["met"]]
        value = goal["value"] if goal["met"] is not None else goal.get("reason")
        lines.append(f"| {goal['goal']} | {_fmt(value)} | {met} |")
    return lines


def _figure_lines(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    peaks = _ok(results, "peaks")
    if peaks:
        lines.append(
            f"- Peaks: GEMM {_fmt(peaks['gemm']['tflops'], 1)} TFLOP/s "
            f"({peaks['gemm']['dtype']}, {peaks['gemm']['m_n_k']}^3), bandwidth "
            f"{_fmt(peaks['bandwidth']['gb_per_s'], 0)} GB/s (device-to-device copy)"
        )
    decode = _ok(results, "decode")
    if decode:
        limit = decode["weight_read_limit"].get("limit_ms")
        lines.append(f"- Decode, 7B shape ({decode['depth']}), limit {_fmt(limit)} ms/step:")
        for backend, run in decode["backends"].items():
            cells = [
                f"batch {r['batch']}: {_fmt(r['ms_per_step'])} ms "
                f"({_fmt(r.get('x_weight_read_limit'))}x)"
                for r in run.get("batches", [])
            ]
            lines.append(f"  - {backend}: " + ("; ".join(cells) or _fmt(run.get("error"))))
    decode_q3 = _ok(results, "decode_q3")
    if decode_q3:
        limit = decode_q3["weight_read_limit"].get("limit_ms")
        lines.append(
            f"- Decode, Qwen3-VL-8B LM shape ({decode_q3['checkpoint']['layers']} layers), "
            f"limit {_fmt(limit)} ms/step (decoder + head bytes / bandwidth):"
        )
        for backend, run in decode_q3["backends"].items():
            cells = [
                f"batch {r['batch']}: {_fmt(r['ms_per_step'])} ms "
                f"({_fmt(r.get('x_weight_read_limit'))}x)"
                for r in run.get("batches", [])
            ]
            lines.append(f"  - {backend}: " + "; ".join(cells))
    for name, label in (("vit", "ViT"), ("vit_q3", "ViT, Qwen3-VL-8B shape,")):
        vit = _ok(results, name)
        for r in vit["images"] if vit else []:
            lines.append(
                f"- {label} {r['image']} ({r['patches']} patches, {vit.get('attention')} "
                f"attention): {_fmt(r['ms'])} ms, "
                f"{_fmt(r['tflops'], 1)} TFLOP/s = {_fmt(r.get('pct_of_gemm_peak'), 1)}% of peak"
            )
    for name, entry in (_ok(results, "parity") or {}).items():
        for prompt, margin in zip(
            entry["prompts"], entry.get("divergence_margins") or [], strict=False
        ):
            if margin:
                lines.append(
                    f"- Parity {name} ({prompt.split()[0]} prompt) diverges at token "
                    f"{margin['index']}: in transformers' logits its token leads ours by "
                    f"{_fmt(margin['gap_theirs_minus_ours'], 3)} "
                    f"({_fmt(margin['gap_in_bf16_ulps'], 1)} bf16 ulps of the top logit "
                    f"{_fmt(margin['top_logit'])}); ours ranks "
                    f"{margin['ours_rank']}"
                )
    layer_ops = _ok(results, "layer_ops")
    if layer_ops:
        cells = [
            f"{r['num_tokens']} tokens: torch {_fmt(r['torch']['per_step_ms'])} ms"
            + (f", triton {_fmt(r['triton']['per_step_ms'])} ms" if "triton" in r else "")
            for r in layer_ops["rows"]
        ]
        lines.append("- Norms, SwiGLU, rotary per step (all layers): " + "; ".join(cells))
    compare = _ok(results, "compare_hf")
    if compare:
        lines.append(
            f"- compare_hf.py, 7B shape: {_fmt(compare['ratio'])}x "
            f"({_fmt(compare['mmserve']['tokens_per_s'], 1)} vs "
            f"{_fmt(compare['transformers']['tokens_per_s'], 1)} tok/s), identical outputs "
            f"{compare['identical_outputs']}/{compare['workload']['requests']}"
        )
    tests = _ok(results, "gpu_tests")
    if tests:
        lines.append(
            f"- tests/models/test_gpu.py: {tests.get('passed')} passed, {tests.get('failed')} "
            f"failed, {tests.get('skipped')} skipped"
        )
    graphs = _ok(results, "graphs")
    if graphs:
        speedups = graphs.get("speedup_by_batch") or {}
        detail = ", ".join(f"batch {b}: {_fmt(x)}x" for b, x in speedups.items())
        sizes = graphs.get("captured_sizes")
        lines.append(
            f"- CUDA graphs: {graphs['status']}"
            + (f"; decode eager/graphs {detail} (captured {sizes})" if detail else "")
            + (f" ({graphs['skipped']})" if graphs.get("skipped") else "")
        )
        for r in graphs.get("vit", {}).get("calls", []):
            lines.append(
                f"  - ViT {r['call']} ({r['patches']} patches in a {r['budget']} budget): "
                f"eager {_fmt(r['eager_ms'])} ms, graph {_fmt(r['graph_ms'])} ms "
                f"({_fmt(r['speedup'])}x; {graphs['vit']['graph']})"
            )
    compiled = _ok(results, "compile")
    if compiled:
        vit = compiled["vit"]
        decode = ", ".join(
            f"batch {r['batch']}: {_fmt(r['speedup_median'])}x" for r in compiled["decode"]
        )
        lines.append(
            f"- torch.compile (-O3) vs eager, {compiled['layers']} layers, paired medians of "
            f"eager/compiled: ViT {vit['image']} {_fmt(vit['speedup_median'])}x; decode "
            f"{decode}; compile {_fmt(compiled['compile_s'], 1)} s, "
            f"{compiled['recompiles_after_warm_up']} recompiles after warm-up"
        )
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    env = _ok(results, "environment") or {}
    date = datetime.date.today().isoformat()
    head = [
        "## GPU suite (`benchmarks/gpu_suite.py`, issue #15)",
        "",
        f"- Date: {date}",
        f"- Machine: {env.get('gpu') or 'CPU only'}, torch {env.get('torch')} (CUDA "
        f"{env.get('cuda_runtime')}), triton {env.get('triton')}, transformers "
        f"{env.get('transformers')}, Python {env.get('python')}",
        f"- mmserve commit: {env.get('commit')} ({env.get('source')}), src digest "
        f"{env.get('src_digest')}",
        f"- Command: `python benchmarks/gpu_suite.py --out gpu_suite.json` "
        f"({_fmt(results.get('wall_s'), 0)} s of a {_fmt(results.get('budget_s'), 0)} s budget)",
        "",
    ]
    skipped = [
        f"{name} ({entry['status']}: "
        f"{entry.get('reason') or entry.get('error', {}).get('message', '')[:120]})"
        for name, entry in results["sections"].items()
        if entry["status"] != "ok"
    ]
    tail = ["", "Sections not run or failed: " + "; ".join(skipped)] if skipped else []
    return "\n".join([*head, *_goal_lines(results), "", *_figure_lines(results), *tail]) + "\n"
