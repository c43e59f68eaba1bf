"""shmcoll: collective communication for multi-process CPU training."""
