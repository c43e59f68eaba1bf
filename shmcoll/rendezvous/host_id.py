"""Host identity: which ranks share a machine (and so its shared memory)."""

from __future__ import annotations

import socket

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def default_host_id() -> str:
    """hostname:boot_id, so a rebooted host or a cloned container name never looks like the same memory."""
    host = socket.gethostname()
    boot = _read_boot_id()
    return f"{host}:{boot}" if boot else host


def kernel_id() -> str:
    """Which running kernel this process is on: its boot id, or "" where /proc does not say. Ranks
    with the same one share a machine's cores, whatever their host ids (network namespaces or
    containers on one machine, each with a host id of its own)."""
    return _read_boot_id() or ""


def _read_boot_id() -> str | None:
    """The kernel's per-boot UUID, or None where /proc is unavailable (macOS, restricted sandboxes)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None

