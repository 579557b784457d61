"""Start the probe: wait for torch, then hook its optimizer steps, its allocator, its saves and OOMs.

Tested in tests/e2e/test_probe.py and tests/e2e/test_probe_matrix.py.

``sitecustomize`` calls ``start()`` in every Python process of the worker. Until the program
imports torch the probe is one finder on ``sys.meta_path``; a program that never does pays one
string comparison per import and writes nothing.
"""

from __future__ import annotations

from . import hook

TYPE_CHECKING = False  # not typing's: every Python process of the worker imports this module
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any


def start(failed: Callable[[str], None]) -> None:
    """``failed(detail)`` writes a failure without the probe's modules (sitecustomize's own)."""
    def attach(torch: ModuleType) -> None:
        # Runs at the end of the program's ``import torch``: an exception would fail that import.
        try:
            _attach(torch)
        except Exception as exc:
            failed(f"the probe did not start: {type(exc).__name__}: {exc}")

    hook.after_import("torch", attach)


def _attach(torch: ModuleType) -> None:
    """Called once torch finished importing. Every failure is a ``probe`` record."""
    import atexit

    from . import channel  # here: the channel's json and the rest are loaded only with torch

    try:
        from . import oom, steps

        counter = steps.install(torch)
        atexit.register(counter.flush)
    except Exception as exc:  # the program goes on; the supervisor reads progress from its output
        channel.failed(f"step hook not installed: {type(exc).__name__}: {exc}")
        return
    tracker = _track_forward(torch, counter)
    parts = _memory_parts(torch, counter, tracker)
    counter.first_step = _at_first_step(tracker, parts)
    try:
        from . import saves

        # a checkpoint's step, measured, before its name's; and the memory's peak so far
        saves.install(torch, lambda: counter.known, parts.at_peak_safely if parts is not None else lambda: None)
    except Exception as exc:
        channel.failed(f"save reporting not installed: {type(exc).__name__}: {exc}")
    try:
        oom.OomReporter(torch, lambda: counter.step, tracker, parts).attach()
    except Exception as exc:
        channel.failed(f"OOM reporting not installed: {type(exc).__name__}: {exc}")


def _track_forward(torch: ModuleType, counter: Any) -> Any:
    """The forward's progress through a step (probe/forward.py), for the OOM record; None where it
    could not be installed (a ``probe`` record says why)."""
    import os

    from . import channel

    tracker = None
    try:
        from . import forward

        tracker = forward.install(torch)
        if tracker is not None:
            counter.extra = tracker.step_figures
            os.register_at_fork(after_in_child=tracker.forget)
            from . import compiled

            compiled.wrap_compile(torch, tracker.compiled)  # gone before dynamo sees them (probe/compiled.py)
            compiled.watch(tracker.compiled)
    except Exception as exc:  # the OOM record goes without the forward's progress
        channel.failed(f"forward tracking not installed: {type(exc).__name__}: {exc}")
    return tracker


def _memory_parts(torch: ModuleType, counter: Any, tracker: Any) -> Any:
    """The memory breakdown's reporter (probe/memsplit.py), its baseline read now, before the model;
    the allocator's history for the attempt after a CUDA OOM (probe/snapshot.py). None if it failed."""
    import atexit
    import os

    from . import channel

    try:
        from . import memsplit as memoryparts
        from . import snapshot

        parts = memoryparts.BreakdownReporter(torch, counter.optimizers, lambda: tracker.root if tracker else None)
        atexit.register(parts.at_peak_safely)
        os.register_at_fork(after_in_child=parts.forget)
        parts.extra = snapshot.install(torch)
        return parts
    except Exception as exc:  # the OOM record goes without its breakdown
        channel.failed(f"memory breakdown not installed: {type(exc).__name__}: {exc}")
        return None


def _at_first_step(tracker: Any, parts: Any = None) -> Callable[[Any], None]:
    """What the process's first optimizer step does: disarm the forward tracker (armed for the first
    step only, probe/forward.py) and read it, read the memory the model holds (probe/memsplit.py),
    then say which model it trains (probe/model.py)."""
    from . import channel, model

    def first(optimizer: Any) -> None:
        if parts is not None:
            try:
                parts.at_first_step(optimizer)  # the gradients and the state exist now, before zero_grad
            except Exception as exc:
                channel.failed(f"memory breakdown at the first step: {type(exc).__name__}: {exc}")
        if tracker is not None:
            if tracker.off_for_compile:  # said once, by a process that trains (a compile worker never steps)
                channel.partial("no forward figures in this process: it compiled (torch.compile) before its first "
                                "optimizer step, and the forward hooks were removed before dynamo could see them")
            tracker.stepped()
        model.report(optimizer)

    return first
