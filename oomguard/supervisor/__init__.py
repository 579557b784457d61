"""The supervisor behind ``oomguard run``, grouped by each module's role in a run.

- ``observe/``: what is happening: memory (psutil, cgroups, PSI), GPUs (NVML), checkpoints on disk,
  the worker's output and structured records, progress and hangs.
- ``decide/``: what it means and what to do: classification of an exit, the pure recovery policy,
  batch arithmetic, the memory model and what earlier runs learned (the fit store).
- ``run/``: carrying it out: the event loop, the worker process and its launcher, its cgroup,
  argv/env rendering, the run-directory lock and the run's states.
- ``record/``: what is kept: the SQLite journal, status documents, the report and logs.
- ``ops/``: the world around a run: systemd, notifications, the terminal status line, doctor.

``cli`` parses the command line, ``config`` is the one typed definition of every option. See
docs/architecture.md for the flow.
"""
