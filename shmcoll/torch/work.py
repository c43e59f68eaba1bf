"""torch `Work` objects for shmcoll's calls, and the threads that complete their futures.

A call that ran on the caller's thread returns a DoneWork: nothing left to wait for, and its
future is only built if somebody asks (most callers just `wait()`). A call handed to the group's
ordered worker returns a PendingWork. Its `wait()` waits on the collective itself; its future is
completed by a Completer thread, never by the ordered worker: torch runs a future's `then`
callbacks on the thread that completes it, and a callback that issues another collective and
waits for it (the PowerSGD hook does) would otherwise block the only thread that can run it.
"""

from __future__ import annotations

import datetime
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout
from ..worker import CollectiveHandle


def _seconds(timeout) -> float | None:
    """torch passes timedelta(0) (or nothing) for "no timeout of its own": the call's deadline rules."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


def _future(result: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return future


class _Failed:
    """A collective's error, carried as the value of PendingWork's source future."""

    def __init__(self, error: BaseException):
        self.error = error


def _outcome(source: torch.futures.Future) -> Any:
    """The source's outputs, or its error raised: raising inside `then` is how a future fails
    for its C++ waiters too (DDP's reducer). Future.set_exception only wraps the error in a value
    that Python unwraps; C++ would take that value for the outputs."""
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class DoneWork(dist.Work):
    """A call that has already finished: its outputs are the future's value."""

    def __init__(self, outputs: list[torch.Tensor]):
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        return _future(self._outputs)


class PendingWork(dist.Work):
    """A collective running on the ordered worker; `finish(result)` (copies into the caller's
    tensors) runs once, on whichever thread first needs the outputs, and returns them."""

    def __init__(self, handle: CollectiveHandle, finish: Callable[[Any], list[torch.Tensor]], completer: Completer):
        super().__init__()
        self._handle, self._finish = handle, finish
        self._lock = threading.Lock()
        self._settled = False
        self._outputs: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._source: torch.futures.Future = torch.futures.Future()
        self._future = self._source.then(_outcome)
        self._future_claimed = False
        self._future_done = threading.Event()  # set first among the future's callbacks
        self._future.add_done_callback(lambda _: self._future_done.set())
        handle.add_done_callback(lambda _: completer.post(self._complete_future))

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            try:
                self._outputs = self._finish(self._handle.join(0))
            except BaseException as exc:  # the collective's error, for wait() and the future
                self._error = exc
            self._settled = True

    def _complete_future(self) -> None:
        """Once, by the Completer or by wait(), whichever comes first (torch expects the future
        done when wait() returns); chained callbacks run on that thread, never on the worker."""
        self._settle()
        with self._lock:
            if self._future_claimed:
                return
            self._future_claimed = True
        self._source.set_result(self._outputs if self._error is None else _Failed(self._error))

    def wait(self, timeout=None) -> bool:
        """Returns once the collective is done and its outputs are in place; raises its error."""
        seconds = _seconds(timeout)
        if not self._handle._event.wait(seconds):
            raise CollectiveTimeout(f"Work.wait({seconds} s) returned before the collective finished; "
                                    "it is still running")
        self._complete_future()
        self._future_done.wait()  # another thread may be completing it: torch expects it done now
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._handle.done()

    def is_success(self) -> bool:
        if not self._handle.done():
            return False
        self._settle()
        return self._error is None

    def exception(self):
        if not self._handle.done():
            return None
        self._settle()
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        return self._future


class Completer:
    """Threads that complete futures. A callback chained on a future may block (waiting on
    another future), so whenever every thread is busy a new one starts; they end at stop()."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: list[threading.Thread] = []

    def post(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.put(job)
            if self._idle:
                self._idle -= 1  # an idle thread will take it
                return
            thread = threading.Thread(target=self._loop, name="shmcoll-torch-completer", daemon=True)
            self._threads.append(thread)
        thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as exc:  # a user's callback failed: torch reports it through the future
                print(f"shmcoll.torch: a future's callback raised {exc!r}", file=sys.stderr)
            with self._lock:
                self._idle += 1

    def stop(self, timeout: float) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
            self._idle = 0
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
