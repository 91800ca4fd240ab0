"""The daemon's helper threads (the step watch, the connection guard), on small stacks.

A thread's stack is a private writable mapping: 8 MiB each by default, counted against
RLIMIT_DATA like the heap. A daemon started under a tight memory limit (the model's weights
and a little more) could load its model and then fail to start these threads ("can't start
new thread"); they run short loops that need a few KiB of C stack, so 512 KiB each is ample.
`threading.stack_size` is process-wide: a thread that another thread (the HTTP server's)
starts in the same instant gets the small stack too; Python code needs little C stack, and
nothing here recurses deeply, so that is accepted rather than locked against.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

STACK_BYTES = 512 << 10


def start_thread(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread:
    """Start a daemon thread running `target(*args)` on a `STACK_BYTES` stack."""
    old = threading.stack_size(STACK_BYTES)
    try:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
    finally:
        threading.stack_size(old)
    return t
