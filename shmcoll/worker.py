"""The ordered background worker behind spawn_all_reduce, and the handle it returns.

One thread runs spawned collectives one at a time in the order they were issued (collectives are
matched across ranks by call order). Blocking collectives wait until the worker is idle and then run
on the caller's thread, so small blocking calls pay no thread hand-off.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from .errors import CollectiveTimeout

_CALLBACKS_LOCK = threading.Lock()


class CollectiveHandle:
    """Result of a spawned collective: join() returns it or re-raises its error; done() polls."""

    def __init__(self, name: str):
        self._name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[CollectiveHandle], None]] = []

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with _CALLBACKS_LOCK:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[[CollectiveHandle], None]) -> None:
        """callback(handle) once the collective has finished: at once if it has, else on the
        worker's thread as it finishes (keep it short: the next collective waits for it)."""
        with _CALLBACKS_LOCK:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def done(self) -> bool:
        return self._event.is_set()

    def join(self, timeout: float | None = None):
        """Wait for the collective (it has its own deadline, so None never waits forever)."""
        if not self._event.wait(timeout):
            raise CollectiveTimeout(f"join({timeout}) returned before the spawned {self._name} finished; "
                                    "it is still running")
        if self._error is not None:
            raise self._error
        return self._result


class OrderedWorker:
    """One daemon thread that runs submitted jobs one at a time, in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: CollectiveHandle | None = None
        self._lock = threading.Lock()

    def submit(self, name: str, job: Callable[[], Any]) -> CollectiveHandle:
        handle = CollectiveHandle(name)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shmcoll-worker", daemon=True)
                self._thread.start()
            self._last = handle
            self._jobs.put((job, handle))
        return handle

    def idle(self) -> bool:
        """Whether everything submitted so far has finished (no waiting)."""
        last = self._last
        return last is None or last._event.is_set()

    def wait_idle(self, timeout: float) -> bool:
        """True once everything submitted so far has finished (successfully or not)."""
        last = self._last
        return last is None or last._event.wait(timeout)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, handle = item
            try:
                handle._finish(result=job())
            except BaseException as exc:  # handed to join(); the worker must go on
                handle._finish(error=exc)

    def stop(self, timeout: float) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None:
            thread.join(timeout)
