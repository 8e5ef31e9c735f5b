"""The agent's own temporary files, known by name.

An API write is atomic: the data goes to a temp file next to the target
(``.NAME.<12 hex>.tmp``), which is renamed over it at the end. A directory
watch sees that literally: a temp file created, written, renamed into place.
What a client of the watch wants to hear is that the file was written, so
each writer registers its temp file's name here (with whether the target
existed), and the watch streams (watch.py) report the temp file's changes as
changes of the file it becomes.

Only names registered here are treated so: a file someone else names like a
temp file is reported as it is. Names are random, so one seen again is the
same write. The table is bounded: the oldest names go first, long after
their watch events were read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_NAMES = 4096
_names: OrderedDict[str, bool] = OrderedDict()
_lock = threading.Lock()  # writers register from worker threads


def register(name: str, existed: bool) -> None:
    """Note the temp file ``name`` (a base name) of a write to a file that
    ``existed`` or not."""
    with _lock:
        _names[name] = existed
        while len(_names) > MAX_NAMES:
            _names.popitem(last=False)


def existed(name: str) -> bool | None:
    """Whether the write through the temp file ``name`` replaced a file (False:
    it made one); None when ``name`` is not one of the agent's temp files."""
    with _lock:
        return _names.get(name)
