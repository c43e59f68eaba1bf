"""shmcoll: collective communication for multi-process CPU training.

Shared memory between ranks on one host, TCP between hosts; see API.md for the contract.

`init`, `ProcessGroup` and `CollectiveHandle` are loaded on first use: they bring in the
transports, the algorithms and the C kernels, which `shmcoll-run` and other tools that only need
the errors, the enums or the launcher should not pay for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, InvalidArgument, PeerLost
from .types import TAG_RESERVED_BASE, DType, ReduceKind

if TYPE_CHECKING:
    from .bootstrap import init
    from .group import ProcessGroup
    from .worker import CollectiveHandle

__all__ = [
    "init", "ProcessGroup", "CollectiveHandle", "ReduceKind", "DType", "TAG_RESERVED_BASE",
    "CollectiveError", "InvalidArgument", "CollectiveTimeout", "PeerLost", "CollectiveMismatch",
]
__version__ = "0.1.0"

_MODULE_OF = {"init": "bootstrap", "ProcessGroup": "group", "CollectiveHandle": "worker"}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
