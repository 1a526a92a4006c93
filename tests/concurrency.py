"""A probe for tests that require work to run on several threads at once."""

import threading
from typing import Optional


class FirstWaitsForASecond:
    """Call it from the work under test: the first call blocks until a second call starts beside it
    (or ``timeout_s`` passes), which work done one piece after another never does.

    Attributes:
        saw_a_second: None before any call; then whether a second call started while the first waited.
        threads: the names of the threads that called.
    """

    def __init__(self, *, timeout_s: float = 10.0) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._second = threading.Event()
        self._calls = 0
        self.saw_a_second: Optional[bool] = None
        self.threads = set()

    def __call__(self) -> None:
        with self._lock:
            self._calls += 1
            first = self._calls == 1
            self.threads.add(threading.current_thread().name)
        if first:
            self.saw_a_second = self._second.wait(timeout=self._timeout_s)
        else:
            self._second.set()
