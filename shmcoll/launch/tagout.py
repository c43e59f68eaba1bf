"""`--tag-output`: every line a rank prints, on stdout or stderr, prefixed with `[rank] `.

Ranks write into pipes; one thread reads them all and writes whole lines only, each in a single
write under one lock, so lines of different ranks never interleave mid-line (a rank's own stdout
and stderr keep their own order, not their relative order, as with mpirun). Bytes pass through
undecoded: a rank's non-UTF-8 output is not the launcher's business.
"""

from __future__ import annotations

import os
import selectors
import threading
from typing import BinaryIO


class LineTagger:
    """Splits a byte stream into lines and prefixes each; keeps an unfinished line for later."""

    def __init__(self, tag: bytes):
        self.tag = tag
        self.partial = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines in partial + chunk, tagged; the rest waits for its newline."""
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        return b"".join(self.tag + line + b"\n" for line in lines)

    def flush(self) -> bytes:
        """At end of stream: the unfinished last line, tagged and given its newline."""
        rest, self.partial = self.partial, b""
        return self.tag + rest + b"\n" if rest else b""


def rank_tag(rank: int) -> bytes:
    return f"[{rank}] ".encode()


class OutputMux:
    """One thread relaying tagged lines from every rank's pipes to the launcher's stdout/stderr."""

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO):
        self.sel = selectors.DefaultSelector()
        self.sinks = (stdout, stderr)
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.open = 0

    def add(self, rank: int, out_fd: int, err_fd: int) -> None:
        """Relay these pipe ends (the mux owns and closes them); call before start()."""
        for fd, sink in ((out_fd, self.sinks[0]), (err_fd, self.sinks[1])):
            self.sel.register(fd, selectors.EVENT_READ, (LineTagger(rank_tag(rank)), sink))
            self.open += 1

    def start(self) -> None:
        """Start relaying (once; later calls do nothing)."""
        if self.thread is not None:
            return
        self.thread = threading.Thread(target=self._run, name="shmcoll-tag-output", daemon=True)
        self.thread.start()

    def _write(self, sink: BinaryIO, data: bytes) -> None:
        if data:
            with self.lock:
                try:
                    sink.write(data)
                    sink.flush()
                except (OSError, ValueError):
                    pass  # the launcher's own output is gone; keep draining so ranks never block

    def _run(self) -> None:
        while self.open:
            for key, _ in self.sel.select():
                tagger, sink = key.data
                chunk = os.read(key.fd, 65536)
                if chunk:
                    self._write(sink, tagger.feed(chunk))
                    continue
                self._write(sink, tagger.flush())
                self.sel.unregister(key.fd)
                os.close(key.fd)
                self.open -= 1

    def join(self, timeout: float) -> bool:
        """Wait for every pipe to end (a rank's leftover helper may hold one open); True if all did."""
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()
