"""compare_vllm_cpu.py's settings: defaults as before, the baseline engine, and what is refused."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """compare_vllm_cpu as its command line runs it: its siblings import as top-level modules."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("compare_vllm_cpu")


def settings(harness: ModuleType, argv: list[str], environ: dict[str, str] | None = None):
    args = harness.parse_args(["run", *argv], environ or {}, "test")
    return harness.settings_from(args)


def test_without_the_new_settings_it_runs_vllm_then_mmserve(harness: ModuleType) -> None:
    s = settings(harness, [])
    assert s.engines == ("vllm", "mmserve")
    assert (s.rounds, s.concurrencies, s.num_prompts) == (2, (16,), 48)
    assert (s.vllm_port, s.mmserve_port) == (8301, 8302)
    assert s.mmserve_base_py is None and s.mmserve_base_pythonpath is None
    assert s.mmserve_py == str(BENCHMARKS.parent / ".venv" / "bin" / "python")
    assert [harness.round_order(s.engines, r) for r in (1, 2)] == [("vllm", "mmserve")] * 2


def test_a_baseline_python_adds_a_third_engine_that_alternates(harness: ModuleType) -> None:
    s = settings(harness, [], {"MMSERVE_BASE_PY": "/base/bin/python", "MMSERVE_BASE_PORT": "9"})
    assert s.engines == ("vllm", "mmserve-base", "mmserve")
    assert s.python_of("mmserve-base") == "/base/bin/python"
    assert s.python_of("mmserve") == s.mmserve_py
    assert [s.port_of(e) for e in s.engines] == [8301, 9, 8302]
    assert [harness.round_order(s.engines, r) for r in (1, 2, 3)] == [
        ("vllm", "mmserve-base", "mmserve"),
        ("vllm", "mmserve", "mmserve-base"),
        ("vllm", "mmserve-base", "mmserve"),
    ]


def test_engines_can_skip_vllm_and_flags_beat_the_environment(harness: ModuleType) -> None:
    environ = {"MMSERVE_BASE_PY": "/env/python", "ENGINES": "vllm,mmserve"}
    argv = ["--engines", " mmserve , mmserve-base", "--mmserve-base-py", "/flag/python"]
    s = settings(harness, argv, environ)
    assert s.engines == ("mmserve-base", "mmserve")  # put in the harness's order
    assert s.mmserve_base_py == "/flag/python"
    assert harness.round_order(s.engines, 2) == ("mmserve", "mmserve-base")
    # A baseline may be configured and still left out of a run.
    assert settings(harness, [], environ).engines == ("vllm", "mmserve")


def test_the_base_pythonpath_reaches_the_baseline_alone(harness: ModuleType) -> None:
    s = settings(harness, ["--mmserve-base-py", "py", "--mmserve-base-pythonpath", "/before/src"])
    environ = {"PYTHONPATH": "/after/src", "HOME": "/h"}
    assert s.mmserve_env("mmserve-base", environ) == {
        "PYTHONPATH": f"/before/src{os.pathsep}/after/src",
        "HOME": "/h",
    }
    assert s.mmserve_env("mmserve", environ) == environ
    assert s.mmserve_env("mmserve-base", {})["PYTHONPATH"] == "/before/src"


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--engines", "mmserve-base,mmserve"], {}, "MMSERVE_BASE_PY is not set"),
        (["--mmserve-base-pythonpath", "/b/src"], {}, "needs MMSERVE_BASE_PY"),
        (["--engines", "vllm,sglang,mmserve"], {}, "unknown sglang"),
        (["--engines", "mmserve"], {}, "at least one engine to compare"),
        (["--engines", "vllm,mmserve-base"], {"MMSERVE_BASE_PY": "p"}, "must hold mmserve"),
        (["--engines", "mmserve,mmserve"], {}, "twice"),
        (["--mmserve-port", "8301"], {}, "VLLM_PORT, MMSERVE_PORT must differ"),
        (["--mmserve-base-port", "8302"], {"MMSERVE_BASE_PY": "p"}, "MMSERVE_BASE_PORT"),
        (["--concurrencies", "0 16"], {}, "positive integers"),
        (["--rounds", "0"], {}, "at least 1"),
    ],
)
def test_refusals(
    harness: ModuleType, argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        settings(harness, argv, environ)


def test_ports_of_engines_left_out_may_collide(harness: ModuleType) -> None:
    argv = ["--engines", "mmserve-base,mmserve", "--vllm-port", "8302"]
    s = settings(harness, argv, {"MMSERVE_BASE_PY": "p"})
    assert s.engines == ("mmserve-base", "mmserve")


def fake_checkout(root: Path) -> Path:
    (root / "mmserve").mkdir(parents=True)
    init = root / "mmserve" / "__init__.py"
    init.write_text("")
    return init


def test_locations_name_each_checkout_and_refuse_the_same_one(
    harness: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    after, before = fake_checkout(tmp_path / "after"), fake_checkout(tmp_path / "before")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "after"))
    argv = ["--mmserve-py", sys.executable, "--mmserve-base-py", sys.executable]
    s = settings(harness, [*argv, "--mmserve-base-pythonpath", str(tmp_path / "before")])
    assert harness.mmserve_locations(s) == {"mmserve-base": str(before), "mmserve": str(after)}

    with pytest.raises(harness.HarnessError, match="both import .*after/mmserve/__init__.py"):
        harness.mmserve_locations(settings(harness, argv))


def test_a_python_that_is_missing_or_cannot_import_mmserve_is_named(
    harness: ModuleType, tmp_path: Path
) -> None:
    missing = settings(harness, ["--mmserve-py", str(tmp_path / "nope")])
    with pytest.raises(harness.HarnessError, match="MMSERVE_PY=.*nope does not exist"):
        harness.mmserve_locations(missing)

    broken = tmp_path / "python"  # stands in for a venv without mmserve
    broken.write_text("#!/bin/sh\necho 'No module named mmserve' >&2\nexit 1\n")
    broken.chmod(0o755)
    argv = ["--mmserve-py", sys.executable, "--mmserve-base-py", str(broken)]
    with pytest.raises(harness.HarnessError, match="MMSERVE_BASE_PY=.*cannot import mmserve"):
        harness.mmserve_locations(settings(harness, argv))
