"""The settings of compare_vllm_cpu.py: environment and flags, checked, and who runs when."""

from __future__ import annotations

import argparse
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from ab_summary import BASE, CANDIDATE, ENGINES, VLLM
from ab_workloads import RANDOM_MM, client_of, resolve_dtype

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Settings:
    vllm_root: Path
    out_dir: Path
    rounds: int
    concurrencies: tuple[int, ...]
    num_prompts: int
    engines: tuple[str, ...]  # in ENGINES order; round_order says who runs when
    vllm_port: int
    mmserve_port: int
    mmserve_base_port: int
    mmserve_py: str
    mmserve_base_py: str | None  # None: no baseline configured
    mmserve_base_pythonpath: str | None  # prepended to PYTHONPATH for the baseline server only
    mmserve_args: tuple[str, ...]
    mmserve_base_args: tuple[str, ...] | None  # the baseline's flags instead; None: mmserve_args
    vllm_args: tuple[str, ...]
    startup_timeout_s: float
    dtype: str  # passed to every server as --dtype
    dtype_reason: str  # why that dtype: printed and recorded with the results
    workload: str  # one of ab_workloads.WORKLOADS

    def __post_init__(self) -> None:
        client_of(self.workload)  # refuses an unknown workload
        for name, args in (
            ("MMSERVE_ARGS", self.mmserve_args),
            ("MMSERVE_BASE_ARGS", self.mmserve_base_args or ()),
            ("VLLM_ARGS", self.vllm_args),
        ):
            if any(a == "--dtype" or a.startswith("--dtype=") for a in args):
                raise ValueError(
                    f"{name} sets --dtype; set DTYPE (--dtype) instead, which every engine gets"
                )
        if self.rounds < 1 or self.num_prompts < 1:
            raise ValueError("ROUNDS and NUM_PROMPTS must be at least 1")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError('CONCURRENCIES must list positive integers, e.g. "1 16 64"')
        if self.mmserve_base_pythonpath and not self.mmserve_base_py:
            raise ValueError(
                "MMSERVE_BASE_PYTHONPATH needs MMSERVE_BASE_PY (which may be the same python "
                "as MMSERVE_PY)"
            )
        check_engines(self.engines, has_base=self.mmserve_base_py is not None)
        ports = [self.port_of(e) for e in self.engines]
        if len(set(ports)) != len(ports):
            names = ", ".join(f"{e.upper().replace('-', '_')}_PORT" for e in self.engines)
            raise ValueError(f"{names} must differ")

    @property
    def venv(self) -> Path:
        return self.vllm_root / "venv"

    @property
    def model_dir(self) -> Path:
        return self.vllm_root / "tiny-qwen2vl"

    def port_of(self, engine: str) -> int:
        return {
            VLLM: self.vllm_port,
            BASE: self.mmserve_base_port,
            CANDIDATE: self.mmserve_port,
        }[engine]

    def args_of(self, engine: str) -> tuple[str, ...]:
        """The extra `mmserve serve` flags of an mmserve engine."""
        if engine == BASE and self.mmserve_base_args is not None:
            return self.mmserve_base_args
        return self.mmserve_args

    def python_of(self, engine: str) -> str:
        """The python that serves an mmserve engine."""
        if engine == BASE:
            assert self.mmserve_base_py is not None  # check_engines refuses BASE without it
            return self.mmserve_base_py
        return self.mmserve_py

    def mmserve_env(self, engine: str, environ: dict[str, str]) -> dict[str, str]:
        """The environment an mmserve engine (its server and its location check) runs with."""
        if engine != BASE or not self.mmserve_base_pythonpath:
            return dict(environ)
        # Prepended: a baseline checkout sharing the candidate's venv must win the import.
        inherited = environ.get("PYTHONPATH")
        paths = [self.mmserve_base_pythonpath, *([inherited] if inherited else [])]
        return {**environ, "PYTHONPATH": os.pathsep.join(paths)}


def check_engines(engines: tuple[str, ...], has_base: bool) -> None:
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"ENGINES: unknown {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    if len(set(engines)) != len(engines):
        raise ValueError(f"ENGINES lists an engine twice: {','.join(engines)}")
    if CANDIDATE not in engines or len(engines) < 2:
        raise ValueError(
            f"ENGINES must hold {CANDIDATE} and at least one engine to compare it with "
            f"({VLLM}, {BASE})"
        )
    if BASE in engines and not has_base:
        raise ValueError(f"ENGINES holds {BASE} but MMSERVE_BASE_PY is not set")


def parse_engines(text: str, has_base: bool) -> tuple[str, ...]:
    """Comma-separated names, put in ENGINES order; empty: every configured engine."""
    if not text.strip():
        return tuple(e for e in ENGINES if e != BASE or has_base)
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    check_engines(names, has_base)
    return tuple(sorted(names, key=ENGINES.index))


def round_order(engines: tuple[str, ...], round_idx: int) -> tuple[str, ...]:
    """vLLM first in every round (as before the baseline existed); the two mmserve engines
    swap places every round (base first in odd rounds), so that drift of the machine within a
    round, or what the previous server left behind, favours neither of them."""
    order = [e for e in ENGINES if e in engines]
    if BASE in engines and round_idx % 2 == 0:
        i, j = order.index(BASE), order.index(CANDIDATE)
        order[i], order[j] = order[j], order[i]
    return tuple(order)


def parse_args(argv: list[str], environ: dict[str, str], description: str) -> argparse.Namespace:
    """The command line; each flag's default is the environment variable of the same name."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("command", choices=["setup", "model", "run", "summarize"])
    parser.add_argument("summary_dir", nargs="?", type=Path, help="summarize: a run's out dir")
    flag = parser.add_argument
    flag("--vllm-root", type=Path, default=environ.get("VLLM_ROOT", "/tmp/mmserve-vllm-cpu"))
    flag("--out-dir", type=Path, default=environ.get("OUT_DIR"))
    flag("--rounds", type=int, default=environ.get("ROUNDS", "2"))
    flag("--concurrencies", default=environ.get("CONCURRENCIES", "16"))
    flag("--num-prompts", type=int, default=environ.get("NUM_PROMPTS", "48"))
    flag("--engines", default=environ.get("ENGINES", ""), help="e.g. mmserve-base,mmserve")
    flag("--vllm-port", type=int, default=environ.get("VLLM_PORT", "8301"))
    flag("--mmserve-port", type=int, default=environ.get("MMSERVE_PORT", "8302"))
    flag("--mmserve-base-port", type=int, default=environ.get("MMSERVE_BASE_PORT", "8303"))
    flag("--mmserve-py", default=environ.get("MMSERVE_PY", str(REPO / ".venv" / "bin" / "python")))
    flag("--mmserve-base-py", default=environ.get("MMSERVE_BASE_PY") or None)
    flag("--mmserve-base-pythonpath", default=environ.get("MMSERVE_BASE_PYTHONPATH") or None)
    flag("--mmserve-args", default=environ.get("MMSERVE_ARGS", ""))
    flag("--mmserve-base-args", default=environ.get("MMSERVE_BASE_ARGS"))
    flag("--vllm-args", default=environ.get("VLLM_ARGS", ""))
    flag("--startup-timeout-s", type=float, default=environ.get("STARTUP_TIMEOUT_S", "600"))
    flag("--dtype", default=environ.get("DTYPE", "auto"), help="auto, float32 or bfloat16")
    flag("--workload", default=environ.get("WORKLOAD", RANDOM_MM), help="random-mm, repeated-image")
    args = parser.parse_args(argv)
    if args.command == "summarize" and args.summary_dir is None:
        parser.error("summarize needs the out dir of a run")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    vllm_root = Path(args.vllm_root)
    dtype, dtype_reason = resolve_dtype(args.dtype)
    return Settings(
        vllm_root=vllm_root,
        out_dir=Path(args.out_dir or vllm_root / "runs" / time.strftime("%Y%m%d-%H%M%S")),
        rounds=args.rounds,
        concurrencies=tuple(int(c) for c in args.concurrencies.split()),
        num_prompts=args.num_prompts,
        engines=parse_engines(args.engines, has_base=args.mmserve_base_py is not None),
        vllm_port=args.vllm_port,
        mmserve_port=args.mmserve_port,
        mmserve_base_port=args.mmserve_base_port,
        mmserve_py=args.mmserve_py,
        mmserve_base_py=args.mmserve_base_py,
        mmserve_base_pythonpath=args.mmserve_base_pythonpath,
        mmserve_args=tuple(shlex.split(args.mmserve_args)),
        mmserve_base_args=None
        if args.mmserve_base_args is None
        else tuple(shlex.split(args.mmserve_base_args)),
        vllm_args=tuple(shlex.split(args.vllm_args)),
        startup_timeout_s=args.startup_timeout_s,
        dtype=dtype,
        dtype_reason=dtype_reason,
        workload=args.workload,
    )
