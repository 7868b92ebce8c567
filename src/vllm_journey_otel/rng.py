"""Our own random numbers, never vLLM's.

vLLM seeds Python's global ``random`` in the engine-core process
(``set_random_seed(model_config.seed)``, seed 0 by default) when the worker runs
there. Trace and span ids, and sampling decisions, drawn from it would repeat
after every restart and on every replica with the same seed (backends would merge
unrelated traces), and each draw would shift vLLM's own random stream. So this
module keeps a private generator seeded from the OS, reseeded in every forked
child (forked engine cores must not share a sequence).

Any thread: ``random.Random`` methods are atomic under the GIL.
"""

from __future__ import annotations

import os
import random

RNG = random.Random(os.urandom(32))


def _reseed() -> None:
    RNG.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed)


def span_id() -> int:
    """A valid (non-zero) 64-bit span id."""
    value = 0
    while not value:
        value = RNG.getrandbits(64)
    return value


def trace_id() -> int:
    """A valid (non-zero) 128-bit trace id."""
    value = 0
    while not value:
        value = RNG.getrandbits(128)
    return value
