"""Find a server's tensor-parallel rank processes (its descendants, by command line)."""

from __future__ import annotations

import os
from pathlib import Path

WORKER_MODULE = "mmserve.execution.parallel.worker_main"


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def rank_pids(root_pid: int) -> dict[int, int]:
    """Global rank -> pid of the rank processes under `root_pid`."""
    children = _children()
    found: dict[int, int] = {}
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in argv if a]
        if WORKER_MODULE in args:
            rank = next(int(a.split("=", 1)[1]) for a in args if a.startswith("--rank="))
            found[rank] = pid
    return found


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
