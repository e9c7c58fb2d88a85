"""How many intra-op threads an engine process takes on a CPU (no torch import: the API process
and the benchmarks read it too).

On a CPU the engine shares the machine with the API process (HTTP, media, image processing)
and, with `-dp N`, with its sibling replicas. libgomp's threads spin while they wait for work
(OMP_WAIT_POLICY=ACTIVE behaviour), so an engine with a thread on every core fought the API
process for each of them: on 2 cores it spent 1.7x the CPU time for the same steps and served
~15% fewer requests, and the engine was held to every core but one. The engine process is now
started with OMP_WAIT_POLICY=PASSIVE (its threads sleep as soon as a parallel region ends), so
it can take every core and give one back the moment the API process needs it: on 2 cores that
served 4-17% more requests than one thread in paired runs (benchmarks/RESULTS.md). Within the
engine, a step whose language-model work is too small to share (a decode of a small model)
runs it on one thread (`execution/lm_threads.py`): waking a sleeping thread per op cost more.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Set in the engine process's environment before torch (and libgomp) load, unless the user's
# environment already says otherwise.
WAIT_POLICY_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def engine_cpu_threads(num_replicas: int, environ: Mapping[str, str], num_cpus: int) -> int:
    """Intra-op threads for one of `num_replicas` engine processes on `num_cpus` CPUs:
    OMP_NUM_THREADS when set; else every CPU split between the replicas when idle threads
    sleep (OMP_WAIT_POLICY=PASSIVE), every CPU but one (the API process's) when they spin."""
    if environ.get("OMP_NUM_THREADS"):
        return max(1, int(environ["OMP_NUM_THREADS"]))
    passive = environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    usable = num_cpus if passive else num_cpus - 1
    return max(1, usable // max(1, num_replicas))
