"""benchmarks/gpu_suite.py cannot rot unnoticed: its CPU smoke run produces every section.

The GPU run is rare (a machine is lent for minutes); this runs the same code on tiny shapes in
float32 on the CPU, so that a renamed API or a broken section fails CI instead of wasting the
next GPU session.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchmarks.suite.alarm import Alarm
from benchmarks.suite.checkpoints import describe_checkpoint
from benchmarks.suite.profile import QWEN2_VL_2B, QWEN2_VL_7B, SMOKE
from benchmarks.suite.report import render_markdown
from benchmarks.suite.vit import vit_flops

from benchmarks import gpu_suite
from mmserve.models.config import VisionConfig
from tests.support.factory import SPECIAL_TOKENS, tiny_config_dict, write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("suite") / "gpu_suite.json"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    start = time.perf_counter()
    # A generous budget: on two idle cores the run takes ~60 s, on a loaded machine over 130 s;
    # a skip would hide a section.
    command = [sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--budget-s", "400"]
    proc = subprocess.run(
        [*command, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,  # inside pytest-timeout's 600 s for the first test
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    results["_test_wall_s"] = time.perf_counter() - start
    return results


def test_every_section_runs_and_the_summary_names_each_goal(smoke: dict) -> None:
    sections = smoke["sections"]
    assert list(sections) == list(gpu_suite.SECTIONS)
    for name, entry in sections.items():
        assert entry["status"] == "ok", (name, entry.get("error") or entry.get("reason"))
        assert entry["wall_s"] >= 0
    summary = smoke["summary"]
    assert len(summary["goals"]) == 4
    for goal in summary["goals"]:
        assert goal["value"] is not None and isinstance(goal["met"], bool), goal
    assert set(summary["section_wall_s"]) == set(gpu_suite.SECTIONS)
    assert smoke["smoke"] is True and smoke["wall_s"] < smoke["budget_s"]


def test_figures_are_measured(smoke: dict) -> None:
    s = {name: entry["result"] for name, entry in smoke["sections"].items()}
    assert s["environment"]["torch"] and s["environment"]["src_digest"]
    assert s["peaks"]["gemm"]["tflops"] > 0 and s["peaks"]["bandwidth"]["gb_per_s"] > 0
    assert [row["image"] for row in s["vit"]["images"]] == ["112x112", "224x112"]
    for row in s["vit"]["images"]:
        assert row["ms"] > 0 and row["tflops"] > 0 and row["pct_of_gemm_peak"] > 0
    assert set(s["checkpoints"]) == {"toy", "qwen2_vl_2b", "qwen2_vl_7b"}
    seven = s["checkpoints"]["qwen2_vl_7b"]
    assert seven["layers"] == 3 and seven["lm_bytes"] > seven["lm_bytes_per_decode_step"] > 0
    tied = s["checkpoints"]["qwen2_vl_2b"]  # the 2B ties its head to the embedding table
    parts = tied["weight_bytes"]
    assert parts["lm_head"] == 0 and parts["embedding"] > 0
    assert (
        tied["lm_bytes_per_decode_step"]
        == tied["lm_bytes"]
        == parts["decoder"] + parts["embedding"]
    )
    # what engines pick without flags on this device, and the resolved fields they report
    defaults = s["environment"]["engine_defaults"]
    assert (defaults["attention_backend"], defaults["layer_ops"]) == ("torch", "torch")
    assert defaults["cuda_graph_sizes"] == [] and defaults["encoder_cuda_graph"] is False
    for field in ("encoder_patch_budget", "cuda_graph_sizes", "layer_ops", "encoder_cuda_graph"):
        assert field in defaults["resolved_config_fields"]
    decode = next(iter(s["decode"]["backends"].values()))
    assert decode["resolved"]["layer_ops"] == "torch"
    assert decode["resolved"]["encoder_patch_budget"] > 0
    assert decode["resolved"]["max_num_seqs"] == 64
    rows = decode["batches"]
    assert [row["batch"] for row in rows] == [1, 8, 64]
    assert any(row["ms_per_step"] for row in rows)  # a tiny CPU model can drown one in noise
    assert s["decode"]["weight_read_limit"]["limit_ms"] > 0
    assert s["compare_hf"]["ratio"] > 0
    assert s["compare_hf"]["identical_outputs"] == SMOKE.compare_requests
    assert s["graphs"]["status"] in ("built", "not built")
    tp = s["tensor_parallel"]
    assert tp["tp1"]["output_tokens"] == SMOKE.tp_prompts * SMOKE.tp_tokens
    assert tp["tp1"]["num_prompts"] == SMOKE.tp_prompts and tp["tp1"]["output_tok_per_s"] > 0
    assert "TP=2 needs two" in tp["tp2"]["absent"]  # the CPU smoke has no GPU
    # encoder graphs exist: the tower is measured with and without them (1024^2 stands in as
    # 112^2 here, and a thumbnail batch), on the eager stand-in of a graph without CUDA
    vit_graphs = s["graphs"]["vit"]
    assert [r["call"] for r in vit_graphs["calls"]] == ["112x112", "2x56x56"]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] > 0 for r in vit_graphs["calls"])
    assert all(r["max_abs_diff"] < 1e-4 for r in vit_graphs["calls"])
    assert vit_graphs["captured"] == [256] and s["vit"]["attention"] == "reference"
    compiled = s["compile"]  # torch.compile vs eager: the engine's compile, paired A/B
    assert compiled["compile_s"] > 0 and compiled["graphs"] > 0
    assert compiled["recompiles_after_warm_up"] == 0
    assert compiled["vit"]["speedup_median"] > 0 and compiled["vit"]["max_abs_diff"] < 1e-4
    assert [r["batch"] for r in compiled["decode"]] == list(SMOKE.compile_batches)
    assert all(r["max_abs_diff"] < 1e-4 for r in compiled["decode"])
    gpu_tests = s["gpu_tests"]
    assert gpu_tests["tests"] >= 7 and gpu_tests["failed"] == 0
    assert gpu_tests["skipped"] == gpu_tests["tests"]  # no CUDA here: every test skips


def test_the_qwen3_vl_rows_run_at_head_dims_that_are_not_powers_of_two(smoke: dict) -> None:
    """The smoke stand-ins of the 8B rows have heads of 24 (the GPU's are 72 and 128)."""
    vit = smoke["sections"]["vit_q3"]["result"]
    assert vit["tower"]["head_dim"] == 24 and vit["tower"]["patch_size"] == 16
    row = vit["images"][0]
    # the main embedding and one level per DeepStack merger, side by side: [tokens, 3 x 96]
    assert row["output_shape"] == [row["tokens"], 3 * 96]
    assert row["ms"] > 0 and row["flops"]["deepstack"] > 0
    assert row["flops"]["total"] == row["flops"]["linear"] + row["flops"]["attention"]
    decode = smoke["sections"]["decode_q3"]["result"]
    assert decode["checkpoint"]["head_dim"] == 24 and decode["checkpoint"]["layers"] == 3
    limit = decode["weight_read_limit"]
    assert limit["limit_ms"] > 0 and limit["lm_bytes"] > limit["lm_bytes_per_decode_step"]
    (run,) = decode["backends"].values()
    assert [r["batch"] for r in run["batches"]] == [1, 8, 64]
    assert any(r["ms_per_step"] for r in run["batches"])
    text = render_markdown(smoke)
    assert "Decode, Qwen3-VL-8B LM shape (3 layers)" in text
    assert "ViT, Qwen3-VL-8B shape," in text


def test_parity_in_float32_is_exact_on_every_checkpoint(smoke: dict) -> None:
    parity = smoke["sections"]["parity"]["result"]
    for name in ("toy", "qwen2_vl_2b", "qwen2_vl_7b"):
        entry = parity[name]
        assert entry["mmserve_vs_transformers"]["identical"], (name, entry)
        assert all(len(t) == SMOKE.parity_tokens for t in entry["mmserve_tokens"])
    assert "mmserve" in parity["toy"]["bf16_vs_fp32"]
    assert parity["toy"]["bf16_vs_fp32"]["mmserve_vs_transformers_fp32"]["identical"]
    assert parity["toy"]["divergence_margins"] == [None, None]  # none where the tokens agree
    assert "skipped" in parity["qwen2_vl_7b"]["bf16_vs_fp32"]


def test_the_report_is_a_results_section(smoke: dict) -> None:
    text = render_markdown(smoke)
    env = smoke["sections"]["environment"]["result"]
    assert text.startswith("## GPU suite")
    assert env["src_digest"] in text
    for goal in smoke["summary"]["goals"]:
        assert goal["goal"] in text
    assert "ViT 112x112 (64 patches, reference attention)" in text
    assert "ViT 2x56x56 (32 patches in a 256 budget): eager" in text


def _run(tmp_path: Path, budget_s: float, work_dir: Path) -> gpu_suite.Run:
    return gpu_suite.Run(
        profile=gpu_suite.dataclasses.replace(SMOKE, budget_s=budget_s),
        out_path=tmp_path / "out.json",
        work_dir=work_dir,
        started=time.perf_counter(),
        results={"sections": {}},
    )


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoints should go")
    run = _run(tmp_path, 60.0, blocker)
    gpu_suite.run_section(run, "checkpoints")
    gpu_suite.run_section(run, "decode")
    run.write()
    sections = json.loads(run.out_path.read_text())["sections"]
    assert sections["checkpoints"]["status"] == "error"
    assert sections["checkpoints"]["error"]["type"] in ("NotADirectoryError", "FileExistsError")
    assert sections["decode"] == {
        "status": "skipped",
        "reason": "needs the checkpoints section, which has status error",
        "wall_s": sections["decode"]["wall_s"],
    }


def test_a_section_past_the_budget_is_stopped_and_later_ones_skipped(tmp_path: Path) -> None:
    # One checkpoint first, outside the budget: the alarm must not land inside transformers'
    # lazy imports, which would leave them half-imported for the tests that follow.
    write_tiny_checkpoint(tmp_path / "warm")
    run = _run(tmp_path, 0.3, tmp_path / "ckpts")
    gpu_suite.run_section(run, "checkpoints")  # writes two checkpoints: several seconds
    gpu_suite.run_section(run, "peaks")
    sections = run.results["sections"]
    assert sections["checkpoints"]["status"] == "error"
    assert sections["checkpoints"]["error"]["type"] == "SectionTimeout"
    assert sections["checkpoints"]["wall_s"] < 10
    assert sections["peaks"]["status"] == "skipped"
    assert sections["peaks"]["reason"].startswith("time budget")


def test_the_gpu_estimates_fit_the_budget_and_leave_the_gpu_tests_time() -> None:
    from benchmarks.suite.profile import GPU

    timed = [name for name in gpu_suite.SECTIONS if name != "environment"]
    assert set(GPU.estimates_s) == set(timed)
    assert gpu_suite.SECTIONS[-1] == "gpu_tests"  # what is left over, never ahead of a goal
    before_tests = sum(GPU.estimates_s[name] for name in timed if name != "gpu_tests")
    # the environment takes a few seconds; the gpu tests need their minimum after the rest
    assert before_tests + 10 + GPU.estimates_s["gpu_tests"] <= GPU.budget_s <= 9 * 60


def test_vit_flops_formula_on_a_hand_count() -> None:
    cfg = VisionConfig(
        model_type="qwen2_vl", depth=1, embed_dim=4, num_heads=1, mlp_hidden_dim=8, out_dim=2
    )
    flops = vit_flops(cfg, num_patches=4)
    patch = 2 * 4 * 1176 * 4
    block = 2 * 4 * 4 * 16 + 2 * 2 * 4 * 4 * 8  # qkv + proj (4d^2 per row), fc1 + fc2
    merger = 2 * 1 * 16 * 16 + 2 * 1 * 16 * 2
    assert flops["linear"] == patch + block + merger
    assert flops["attention"] == 2 * 2 * 4 * 4 * 4


@pytest.mark.parametrize(
    ("shape", "billions", "vision_billions"),
    [(QWEN2_VL_2B, 2.209, 0.665), (QWEN2_VL_7B, 8.291, 0.676)],
)
def test_full_shapes_have_the_published_parameter_counts(
    shape: dict, billions: float, vision_billions: float
) -> None:
    """Built on the meta device (no memory): a typo in a width would change the counts."""
    import torch
    import transformers

    ids = {token: 151643 + i for i, token in enumerate(SPECIAL_TOKENS)}
    cfg = tiny_config_dict("qwen2_vl", 448, ids, **shape)
    config = transformers.Qwen2VLConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.Qwen2VLForConditionalGeneration(config)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for name, p in model.named_parameters() if "visual" in name)
    assert round(total / 1e9, 3) == billions
    assert round(vision / 1e9, 3) == vision_billions


def test_the_qwen3_vl_8b_rows_have_its_shapes() -> None:
    """The GPU rows, checked on the CPU: the tower's dims and tokens at 1024^2, and the language
    model's weight bytes per decode step (the limit's numerator), counted on the meta device."""
    import torch
    import transformers
    from benchmarks.suite.profile import GPU, QWEN3_VL_8B_LM
    from benchmarks.suite.qwen3_vl import MAX_PIXELS, MIN_PIXELS, q3_vision_config

    from mmserve.models.config import parse_model_config
    from mmserve.processing.image_processor import smart_resize

    cfg = q3_vision_config(GPU.q3_vit_shape)
    assert (cfg.depth, cfg.embed_dim, cfg.num_heads, cfg.head_dim) == (27, 1152, 16, 72)
    assert cfg.patch_size == 16 and cfg.deepstack_visual_indexes == (8, 16, 24)
    assert cfg.position_table_side == 48
    h, w = smart_resize(1024, 1024, factor=32, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert (h // 16) * (w // 16) == 4096  # patches: 1,024 tokens after the 2x2 merge
    ids = {token: 151643 + i for i, token in enumerate(SPECIAL_TOKENS)}
    raw = tiny_config_dict("qwen3_vl", 448, ids, **QWEN3_VL_8B_LM)
    parsed = parse_model_config(raw)
    assert parsed.architecture == "Qwen3VLForConditionalGeneration"
    text = parsed.text
    assert (text.hidden_size, text.num_hidden_layers) == (4096, 36)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (32, 8, 128)
    assert text.mrope_section == (24, 20, 20) and not parsed.tie_word_embeddings
    config = transformers.Qwen3VLConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.Qwen3VLForConditionalGeneration(config)
    per_step = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "visual" not in name and "embed_tokens" not in name
    )
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 128  # q, o, k, v, q/k norms
    layer = attention + 3 * 4096 * 12288 + 2 * 4096  # + MLP, two norms
    assert per_step == 36 * layer + 4096 + 151936 * 4096  # + final norm, untied head
    assert round(2 * per_step / 1e9, 1) == 15.1  # GB in bf16: 3.6 ms at 4.2 TB/s


def test_a_bf16_checkpoint_counts_two_bytes_per_weight(tmp_path: Path) -> None:
    fp32 = describe_checkpoint(write_tiny_checkpoint(tmp_path / "a", dtype="float32"))
    bf16 = describe_checkpoint(write_tiny_checkpoint(tmp_path / "b", dtype="bfloat16"))
    assert fp32["lm_bytes"] == 2 * bf16["lm_bytes"] > 0
    parts = bf16["weight_bytes"]
    # untied: the step reads the decoder and the head, not the embedding table
    assert bf16["lm_bytes_per_decode_step"] == parts["decoder"] + parts["lm_head"]


def test_an_alarm_swallowed_by_library_code_still_counts_and_earlier_timers_survive() -> None:
    def outer(signum: int, frame: object) -> None:
        raise AssertionError("the outer timer must not fire inside this test")

    previous = signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 30.0)  # like pytest-timeout's
    try:
        # contextlib.suppress(BaseException): what some library code does to our alarm
        with Alarm(0.05) as alarm, contextlib.suppress(BaseException):
            time.sleep(2.0)  # interrupted by the alarm
        assert alarm.fired
        assert signal.getsignal(signal.SIGALRM) is outer
        assert 25.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
