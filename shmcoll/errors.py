"""The exceptions shmcoll raises; every one derives from CollectiveError (a RuntimeError)."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """Base of every error raised by shmcoll."""

    #: True on an error another rank reported and this one relays (start-up never publishes it again).
    from_peer: bool = False


class InvalidArgument(CollectiveError, ValueError):
    """Bad input, detected before anything was sent; the group stays usable."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A blocking call ran past the group's timeout; the group is broken afterwards."""


class PeerLost(CollectiveError, ConnectionError):
    """A peer died or closed its connection; `.peer` is its rank (None when unknown)."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class CollectiveMismatch(CollectiveError):
    """Ranks called different collectives, dtypes or lengths at the same sequence number."""


class ShmSetupError(CollectiveError):
    """Shared memory could not be set up (too little space, permissions, ...); says what to do."""


_BY_NAME = {cls.__name__: cls for cls in (CollectiveError, InvalidArgument, CollectiveTimeout, PeerLost,
                                          CollectiveMismatch, ShmSetupError)}


def error_of_kind(kind: str, message: str, peer: int | None = None) -> CollectiveError:
    """Rebuild an error another rank reported by class name (unknown names: CollectiveError)."""
    cls = _BY_NAME.get(kind, CollectiveError)
    return cls(message, peer) if cls is PeerLost else cls(message)
