"""Python's cycle collector, tuned for a process that keeps what it parses.

The operator's heap is mostly objects that live as long as their Kubernetes
object does: the bodies in Kopf's indexes and memories. The collector's
default thresholds walk them again and again (a full collection at 1,000
Sandboxes takes about 0.2 s, and there are more of them the bigger the heap
grows); `config.Settings.gc_thresholds` says why the operator's are larger.
"""

from __future__ import annotations

import gc


def configure(thresholds: tuple[int, int, int]) -> None:
    """Set the collector's thresholds and leave what exists at startup (modules,
    classes, Kopf's registry: never garbage) out of every later collection."""
    gc.set_threshold(*thresholds)
    gc.collect()
    gc.freeze()
