"""Starting ranks: local spawning and the shmcoll-run command line."""

from shmcoll.launch.local import launch_local

__all__ = ["launch_local"]
