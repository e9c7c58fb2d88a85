"""The CPU engine asks glibc to keep freed host memory for reuse (benchmarks/RESULTS.md has the
effect on benchmarks/compare_hf.py; page-fault counts depend on heap layout too much for a
test to pin them down)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from mmserve.host_allocator import limit_malloc_arenas, tune_host_allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_tuning_applies_on_glibc_and_is_idempotent():
    assert tune_host_allocator() is True
    assert tune_host_allocator() is True


def test_tuning_is_a_no_op_elsewhere(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert tune_host_allocator() is False


_COUNT_ARENAS = """
import ctypes, sys, tempfile, threading
from mmserve.host_allocator import limit_malloc_arenas
if sys.argv[1] == "limited":
    assert limit_malloc_arenas(2)
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
ready, go = threading.Barrier(9), threading.Event()
def hold():
    block = bytearray(1 << 20)  # served by malloc, not by Python's small-object allocator
    ready.wait()
    go.wait()
threads = [threading.Thread(target=hold) for _ in range(8)]
for t in threads:
    t.start()
ready.wait()  # eight threads alive at once, each has allocated
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    print(open(f.name).read().count("<heap nr="))
go.set()
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc arenas only")
def test_arena_cap_keeps_many_threads_in_two_arenas():
    def arenas(kind: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _COUNT_ARENAS, kind],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(out.stdout)

    assert arenas("limited") <= 2
    assert arenas("default") > 2  # without the cap each new thread gets an arena of its own
    with pytest.raises(ValueError, match="max_arenas"):
        limit_malloc_arenas(0)
