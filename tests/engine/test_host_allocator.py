"""The CPU engine asks glibc to keep freed host memory for reuse (benchmarks/RESULTS.md has the
effect on benchmarks/compare_hf.py; page-fault counts depend on heap layout too much for a
test to pin them down)."""

from __future__ import annotations

import platform

import pytest

from mmserve.engine.host_allocator import tune_host_allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_tuning_applies_on_glibc_and_is_idempotent():
    assert tune_host_allocator() is True
    assert tune_host_allocator() is True


def test_tuning_is_a_no_op_elsewhere(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert tune_host_allocator() is False
