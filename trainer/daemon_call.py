"""A call that may hang (a server, a rendezvous) made on a daemon thread: the caller waits for it in
Python, where signal handlers run, for as long as it chooses, and a hung call cannot hold the exit."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable


def daemon_call(fn: Callable[[], object], name: str) -> Future:
    """Start fn() on a daemon thread named `name`. Wait with `concurrent.futures.wait([f], timeout)`;
    `f.result()` raises on the waiting thread whatever fn raised."""
    future: Future = Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as e:  # the waiting thread's to handle
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
