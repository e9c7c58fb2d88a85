"""This process's glibc malloc policy: the CPU worker's thresholds and every server's arena cap.

A leaf (ctypes only, no torch): the API process caps its arenas before its threads start, and
the CPU worker keeps freed host memory in the process instead of handing it back to the OS
after each step.

glibc's malloc serves large blocks with mmap and trims the top of the heap as soon as a few
tens of MB are free, so a CPU engine that allocates the same activation buffers every step
(K/V gathered for decodes, ViT attention scores) pays to fault fresh zeroed pages in every
time: over a quarter of a 2-thread CPU run of benchmarks/compare_hf.py went to that. Raising
both thresholds makes malloc reuse what it already has; resident memory then stays at its peak
(bounded by what the engine ever held at once, plus at most TRIM_THRESHOLD of idle heap).
benchmarks/RESULTS.md has the measured effect.

The server also caps the number of malloc arenas, on every device. glibc gives each new thread
an arena of its own (up to 8 per core), and a server processes pictures on many threads: image
buffers of every size freed in many arenas leave holes that no arena hands back, so resident
memory crept up with every new picture long after the caches were full (issue #20;
benchmarks/soak_rss.py measures it, benchmarks/RESULTS.md has the figures).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt(3) parameter numbers from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Blocks below this come from the heap, not from a fresh mmap. 32 MiB is the most glibc honours
# on 64-bit Linux (larger values are accepted and silently ignored), so bigger blocks still
# fault in every time.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of free heap top instead of returning it
# The main arena plus one shared by every other thread. Large blocks (the only ones that reach
# glibc: Python's own allocator serves objects under 512 bytes) are few per request, so threads
# rarely wait on the shared arena's lock; in benchmarks/soak_rss.py runs 2 levelled off best
# (4 still crept a little). The offline API keeps glibc's default: it measured ~5% slower.
MALLOC_ARENA_MAX = 2


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def limit_malloc_arenas(max_arenas: int = MALLOC_ARENA_MAX) -> bool:
    """Cap glibc's malloc arenas (threads beyond it share); False on other C libraries.

    Call it before the threads that allocate start: an arena, once made, is never removed.
    """
    if max_arenas <= 0:
        raise ValueError(f"max_arenas must be positive, got {max_arenas}")
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, max_arenas))


def tune_host_allocator() -> bool:
    """Apply the thresholds above to this process's glibc malloc; False (and nothing changed)
    on other C libraries or when glibc refuses a value. Idempotent."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        logger.warning("glibc refused the malloc thresholds; CPU steps may page-fault more")
    return ok
