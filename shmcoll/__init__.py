"""shmcoll: collective communication for multi-process CPU training.

Shared memory between ranks on one host, TCP between hosts; see API.md for the contract.
"""

from .bootstrap import init
from .errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, InvalidArgument, PeerLost
from .group import ProcessGroup
from .types import TAG_RESERVED_BASE, DType, ReduceKind
from .worker import CollectiveHandle

__all__ = [
    "init", "ProcessGroup", "CollectiveHandle", "ReduceKind", "DType", "TAG_RESERVED_BASE",
    "CollectiveError", "InvalidArgument", "CollectiveTimeout", "PeerLost", "CollectiveMismatch",
]
__version__ = "0.1.0"
