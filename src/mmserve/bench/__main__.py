"""`python -m mmserve.bench serve ...`: the bench without the top-level `mmserve` CLI."""

from __future__ import annotations

import argparse
import sys

from mmserve.bench.cli import add_bench_serve_args, run_bench_serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmserve.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    add_bench_serve_args(commands.add_parser("serve", help="benchmark an OpenAI-compatible server"))
    args = parser.parse_args(argv)
    return run_bench_serve(args)


if __name__ == "__main__":
    sys.exit(main())
