"""Carrying out decisions: the event loop, the worker's process, launcher and cgroup, the run's states."""
