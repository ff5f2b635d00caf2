"""Give freed large tensors back to the operating system (glibc only).

glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which
tensors of a few MiB to 32 MiB (a layer's weights, gradients, optimizer temporaries) come from
the heap, and freed ones stay resident. A worker then holds ~2 extra copies of its model that
nothing uses. A fixed threshold keeps such blocks in their own mappings, returned on free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
DEFAULT_THRESHOLD = 4 << 20


def release_freed_tensors(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fixes glibc's mmap threshold at ``threshold`` bytes for this process; False where not glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError) as e:  # musl and others have no mallopt
        log.debug("mallopt unavailable: %s", e)
        return False
