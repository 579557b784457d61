"""Start the probe: wait for torch, then hook its optimizer steps, its allocator, its saves and OOMs.

Tested in tests/e2e/test_probe.py, tests/e2e/test_probe_matrix.py and tests/unit/probe/test_steps.py
(the post-import hook).

``sitecustomize`` calls ``start()`` in every Python process of the worker. Until the program
imports torch the probe is one finder on ``sys.meta_path``; a program that never does pays one
string comparison per import and writes nothing. The finder (``AfterImport``) lets the other
finders find the module, then wraps the found loader so that the callback runs right after the
module's own code: wrapt's and ddtrace's post-import hooks; the module keeps its real loader in
``__spec__``. The probe never imports torch itself nor touches it half-built.
"""

from __future__ import annotations

import os  # loaded by site before any sitecustomize: no cost
import sys

TYPE_CHECKING = False  # not typing's: every Python process of the worker imports this module
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    Callback = Callable[[ModuleType], None]


def start(failed: Callable[[str], None]) -> None:
    """``failed(detail)`` writes a failure without the probe's modules (sitecustomize's own)."""
    def attach(torch: ModuleType) -> None:
        # Runs at the end of the program's ``import torch``: an exception would fail that import.
        try:
            _attach(torch)
        except Exception as exc:
            failed(f"the probe did not start: {type(exc).__name__}: {exc}")

    after_import("torch", attach)


class _ThenCall:
    """The found loader, with ``callback`` run after it executed the module."""

    def __init__(self, loader: Any, callback: Callback) -> None:
        self._loader, self._callback = loader, callback

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its own loader while it runs (importlib.resources, pkgutil ask for it).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._callback(module)


class AfterImport:
    """A ``sys.meta_path`` finder that runs ``callback(module)`` once ``name`` is imported."""

    def __init__(self, name: str, callback: Callback) -> None:
        self.name, self._callback, self._searching = name, callback, False

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != self.name or self._searching:
            return None  # the cost for every other import: one comparison
        self._searching = True
        try:
            spec = _find_elsewhere(self, fullname, path, target)
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _ThenCall(spec.loader, self._imported)  # type: ignore[assignment]
        return spec

    def _imported(self, module: ModuleType) -> None:
        if self in sys.meta_path:  # once: later imports of the name are lookups in sys.modules
            sys.meta_path.remove(self)
        self._callback(module)


def _find_elsewhere(finder: AfterImport, fullname: str, path: Sequence[str] | None,
                    target: ModuleType | None) -> ModuleSpec | None:
    for other in list(sys.meta_path):
        find = getattr(other, "find_spec", None)
        if other is finder or find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


def after_import(name: str, callback: Callback) -> None:
    """Run ``callback(module)`` once ``name`` has finished importing (now, if it already has)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    sys.meta_path.insert(0, AfterImport(name, callback))


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
        # a checkpoint's step, measured, before its name's; and the memory's peak so far
        steps.wrap_save(torch, lambda: counter.known, parts.at_peak_safely if parts is not None else lambda: None)
    except Exception as exc:
        channel.failed(f"save reporting not installed: {type(exc).__name__}: {exc}")
    try:
        oom.OomReporter(torch, lambda: counter.step, tracker, parts).attach()
    except Exception as exc:
        channel.failed(f"OOM reporting not installed: {type(exc).__name__}: {exc}")


def _track_forward(torch: ModuleType, counter: Any) -> Any:
    """The forward's progress through a step (probe/forward.py), for the OOM record; None where it
    could not be installed (a ``probe`` record says why)."""
    from . import channel

    tracker = None
    try:
        from . import forward

        tracker = forward.install(torch)
        if tracker is not None:
            counter.extra = tracker.step_figures
            os.register_at_fork(after_in_child=tracker.forget)
            forward.wrap_compile(torch, tracker.compiled)  # gone before dynamo sees them
            forward.watch(tracker.compiled)
    except Exception as exc:  # the OOM record goes without the forward's progress
        channel.failed(f"forward tracking not installed: {type(exc).__name__}: {exc}")
    return tracker


def _memory_parts(torch: ModuleType, counter: Any, tracker: Any) -> Any:
    """The memory breakdown's reporter (probe/memory.py), its baseline read now, before the model;
    the allocator's history for the attempt after a CUDA OOM (``memory.Snapshots``). None if it failed."""
    import atexit

    from . import channel

    try:
        from . import memory

        parts = memory.BreakdownReporter(torch, counter.optimizers, lambda: tracker.root if tracker else None)
        atexit.register(parts.at_peak_safely)
        os.register_at_fork(after_in_child=parts.forget)
        parts.extra = memory.install_snapshots(torch)
        return parts
    except Exception as exc:  # the OOM record goes without its breakdown
        channel.failed(f"memory breakdown not installed: {type(exc).__name__}: {exc}")
        return None


def _at_first_step(tracker: Any, parts: Any = None) -> Callable[[Any], None]:
    """What the process's first optimizer step does: disarm the forward tracker (armed for the first
    step only, probe/forward.py) and read it, read the memory the model holds (probe/memory.py),
    then say which model it trains (``steps.report_model``)."""
    from . import channel, steps

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
        steps.report_model(optimizer)

    return first
