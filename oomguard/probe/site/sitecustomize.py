"""oomguard's probe, loaded into every Python process of a supervised worker (docs/probe.md).

Tested in tests/e2e/test_probe.py (a user's own sitecustomize still runs).

oomguard puts this directory first on the worker's PYTHONPATH, as ``opentelemetry-instrument`` and
``ddtrace-run`` do. It holds only this file, so it shadows nothing but ``sitecustomize``: the user's
own one, if any, is run right after the probe starts. Nothing here may raise into the program.
"""

from __future__ import annotations

import os
import sys
import time

_PACKAGE = "_oomguard_probe"  # the oomguard tree this file lives in, under a name no one else uses
_EVENTS = "OOMGUARD_EVENTS"


def _start_probe() -> None:
    """Load the probe from this file's own tree (the worker may run another interpreter or venv,
    with another oomguard or none) and start it; a failure is one record, never an exception."""
    if not os.environ.get(_EVENTS):
        return  # not under the supervisor (a PYTHONPATH that leaked): stay out of the way
    try:
        from importlib.machinery import ModuleSpec

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        spec = ModuleSpec(_PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [root]
        package = type(sys)(_PACKAGE)
        package.__spec__, package.__path__ = spec, [root]  # its __init__ is never run: it may import more
        sys.modules[_PACKAGE] = package
        __import__(_PACKAGE + ".probe.start", fromlist=["start"]).start(_failed)
    except Exception as exc:  # the probe is optional; the program is not
        _failed(f"the probe did not load: {type(exc).__name__}: {exc}")


def _failed(detail: str) -> None:
    """One ``probe`` record (state failed) written without the probe's own modules, which may be
    what failed; the channel's format is common/protocol.py's."""
    import json  # here, not at the top: every Python process of the worker runs this file

    def number(name: str) -> int | None:
        value = os.environ.get(name, "")
        return int(value) if value.isdigit() else None

    record = {"type": "probe", "t": time.time(), "state": "failed", "detail": detail[:500], "pid": os.getpid(),
              "rank": number("RANK"), "local_rank": number("LOCAL_RANK"), "world_size": number("WORLD_SIZE")}
    try:
        fd = os.open(os.environ[_EVENTS], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # nowhere to say it: the run goes on without the probe


def _chain_user_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one hides, as Python would have without oomguard. Its own
    errors are reported by ``site`` as they would be (``Error in sitecustomize``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [i for i, entry in enumerate(sys.path) if os.path.abspath(entry or os.curdir) == here]
    saved = list(sys.path)
    ours = sys.modules.pop("sitecustomize", None)
    for index in reversed(entries):
        del sys.path[index]
    try:
        __import__("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours  # there is none: ours stays the one imported
    finally:
        # Back in place for anyone who inspects sys.path; the user's module is imported already.
        sys.path[:] = saved + [p for p in sys.path if p not in saved]


_start_probe()
_chain_user_sitecustomize()
