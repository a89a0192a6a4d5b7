"""`paused_gc()`: run a block with Python's cyclic garbage collector paused.

Lowering and validating a large plan allocate hundreds of thousands of small objects (instructions,
index tuples) that form no reference cycles; the collector, triggered by the allocation count, then
re-walks the whole growing heap again and again, which took about half of `lower` and `check`. Pausing
it changes no result: reference counting still frees everything, and the collector runs again (and
finds whatever cycles exist) as soon as the block ends. The previous state is restored, so nesting and
callers that disabled the collector themselves are respected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic collector for the block, then restore whatever state it had."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
