"""Counting optimizer steps from torch's global step hook, and what a step tells: the model trained,
the step a checkpoint save holds.

Tested in tests/unit/probe/test_steps.py, tests/e2e/test_probe.py and tests/e2e/test_step_truth.py.

``register_optimizer_step_post_hook`` fires after every ``Optimizer.step`` of every optimizer, in
any framework. A training iteration may step several optimizers (a GAN's generator and
discriminator), or a wrapper whose step calls an inner one (accelerate's ``AcceleratedOptimizer``):
each optimizer is counted on its own and the step is the largest count, so an iteration is one
step. After a resume the count goes on from the resumed step: an Adam-family optimizer carries it
in its restored state (``state[p]["step"]``), else the supervisor's ``OOMGUARD_CHECKPOINT_STEP``.

The hook does a dictionary lookup, two additions and a clock read; a ``step`` record is written at
most every ``every`` seconds (the first step at once, the last one at exit).

An optimizer step the program runs inside ``torch.compile`` (``torch.compile(opt.step)``, a compiled
function that steps) is not counted: dynamo traces the hook into the compiled code, where anything
it did would be a graph break or a guard (a count read is an int dynamo specializes on: a recompile
per step). Traced, the hook only stores a constant (``compiled_steps_seen``), which dynamo replays
after each compiled step without a guard; the probe says once that such steps go uncounted.

The ``model`` record (``fingerprint``), once per process at its first optimizer step: a digest of
the optimizer's class and, in order, each parameter's shape, dtype and ``requires_grad``, so a layer
more, a wider embedding, a longer position table, half precision or frozen weights are another
model, whatever file changed it; the supervisor's fit store keeps it with what it measured, so a
re-run of a changed model is not started at a size measured for another. The forward's input shape
is left out: keyword tensors (HF-style) escape torch's global forward pre-hook, and dynamic padding
would make the same job look new (a model whose sequence length is in its weights, nanoGPT's
``wpe``, is caught by the shapes). ``python bench/probe_cost.py`` times it (docs/probe.md).

The ``save`` record (``wrap_save``): a checkpoint whose name carries no step (nanoGPT rewrites
``out/ckpt.pt``) once took its step from the last step record before the file's mtime, steps short.
The save knows: the record says the step counted when the save began (none before the process's
first step: nanoGPT re-saves right after resuming, before its resumed count is read), and when it
began and returned; the file's mtime lies between whatever it is renamed to afterwards. Two clock
reads and one record per save; the save's own exception goes to the program unchanged. A program
that took ``torch.save`` before torch finished importing keeps the unwrapped one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..common import protocol
from . import channel, memory

EVERY = 0.5  # seconds between two step records of one process


def resumed_step(optimizer: Any, fallback: int) -> int:
    """The step the optimizer's state was resumed at, read right after its first step here:
    its state's ``step`` less this one step; ``fallback`` when its state keeps none (SGD)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and "step" in state:
                return max(0, int(float(state["step"])) - 1)  # one scalar, read once per optimizer
    return fallback


class StepCounter:
    """The post hook and the summary: ``step`` is the step reached, resumed count included."""

    def __init__(self, torch: Any, clock: Callable[[], float] = time.monotonic, every: float = EVERY) -> None:
        self._torch, self._clock, self._every = torch, clock, every
        # Called once, at this process's first step, with the optimizer that took it.
        self.first_step: Callable[[Any], None] | None = None
        self.extra: Callable[[], dict[str, Any]] | None = None  # more fields for each step record
        compiler = getattr(torch, "compiler", None)
        # True while dynamo traces the hook (torch < 2.3 has no such test: its dynamo did not trace hooks).
        self._compiling: Callable[[], bool] = getattr(compiler, "is_compiling", None) or (lambda: False)
        self.forget()

    def forget(self) -> None:
        """Start from nothing (also in a forked child, which takes no step of its parent's)."""
        self.step = 0
        self._counts: dict[int, list[Any]] = {}  # id(optimizer) -> [count, resumed step, weakref]
        self._local = 0  # iterations here (the largest count), for ``steps``
        self._reported = 0
        self._last: float | None = None
        self._next = 0.0
        self._said: set[str] = set()
        self.compiled_steps_seen = False  # set by compiled code after a step it ran (never reset)

    def optimizers(self) -> list[Any]:
        """The optimizers this process stepped that are still alive."""
        return [o for entry in list(self._counts.values()) if (o := entry[2]()) is not None]

    @property
    def known(self) -> int | None:
        """The step reached, or None before this process's first optimizer step: a resumed count is
        read at that step (``resumed_step``), so before it the count says 0 after a resume."""
        self.tell_compiled()  # a save: one of the few moments a fully compiled loop runs our code
        return self.step if self._local > 0 else None

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global optimizer post hook: one step of ``optimizer``. Never raises into it."""
        if self._compiling():
            # Traced into compiled code: a constant store is all dynamo replays without a guard or a break.
            self.compiled_steps_seen = True
            return
        try:
            entry = self._counts.get(id(optimizer))
            if entry is None:
                entry = self._first_step(optimizer)
            entry[0] += 1
            if entry[0] > self._local:
                self._local = entry[0]
            if entry[0] + entry[1] > self.step:
                self.step = entry[0] + entry[1]
            now = self._clock()
            if now >= self._next:
                self.report(now)
        except Exception as exc:  # a bug of ours must not end a training run
            self._broken(f"step hook: {type(exc).__name__}: {exc}")

    def tell_compiled(self) -> None:
        """Say once that optimizer steps ran compiled, uncounted (the step is then read from the output)."""
        if self.compiled_steps_seen and "compiled" not in self._said:
            self._said.add("compiled")
            channel.partial("optimizer steps run inside torch.compile are not counted: dynamo would trace "
                            "the step hook into the compiled code")

    def _broken(self, detail: str) -> None:
        if detail not in self._said:
            self._said.add(detail)  # once per problem, not once per step
            channel.failed(detail)

    def _first_step(self, optimizer: Any) -> list[Any]:
        # This process's first step (data-loader workers never step): say the probe is here, once. Not
        # ``not self._counts``: an optimizer dropped (an LR finder's) empties it, and the next is no first.
        if self._local == 0:
            channel.loaded(f"torch {getattr(self._torch, '__version__', '?')}")
            if self.first_step is not None:
                self.first_step(optimizer)
        fallback = channel.env_int(protocol.ENV_CHECKPOINT_STEP) or 0
        key = id(optimizer)
        # The weakref drops the entry with the optimizer, so a new one that gets its id starts at 0.
        entry = [0, resumed_step(optimizer, fallback), weakref.ref(optimizer, lambda _: self._counts.pop(key, None))]
        self._counts[key] = entry
        return entry

    def report(self, now: float | None = None) -> None:
        """Write a ``step`` record: the steps since the last one, how long they took, the memory."""
        now = self._clock() if now is None else now
        self.tell_compiled()
        steps, self._reported = self._local - self._reported, self._local
        seconds = None if self._last is None else round(now - self._last, 6)  # the first step's start is unknown
        self._last, self._next = now, now + self._every
        try:
            devices = memory.device_peaks(self._torch)
        except Exception as exc:  # a torch whose allocator API moved: steps still count
            devices = {}
            self._broken(f"allocator peaks: {type(exc).__name__}: {exc}")
        # Under RLIMIT_AS the address space is what bounds a CPU process: its peak is the figure to fit.
        vm_limit, held = memory.address_space_limit(), memory.statm()
        channel.emit(protocol.STEP, step=self.step, steps=steps, seconds=seconds,
                     rss_bytes=held[1] if held else None, devices=devices, vm_limit_bytes=vm_limit,
                     vm_peak_bytes=memory.status_bytes(b"VmPeak:") if vm_limit is not None else None,
                     **(self.extra() if self.extra is not None else {}))

    def flush(self) -> None:
        """At exit: the steps taken since the last record."""
        self.tell_compiled()
        if self._local > self._reported:
            self.report()


def install(torch: Any) -> StepCounter:
    """Count every optimizer step of this process; raises when this torch has no global hook."""
    try:
        optimizer_module = importlib.import_module("torch.optim.optimizer")  # torch.optim hides the name
    except ImportError:
        optimizer_module = None
    register = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
    if register is None:
        raise RuntimeError(f"torch {getattr(torch, '__version__', '?')} has no global optimizer step hook "
                           "(torch.optim.optimizer.register_optimizer_step_post_hook, torch 2.0 and later)")
    counter = StepCounter(torch)
    register(counter.on_step)
    os.register_at_fork(after_in_child=counter.forget)
    return counter


def fingerprint(optimizer: Any) -> dict[str, Any]:
    """The ``model`` record's fields for ``optimizer`` (raises on an optimizer torch would not step)."""
    kind = type(optimizer)
    parts = [f"{kind.__module__}.{kind.__qualname__}"]
    tensors = params = 0
    for group in optimizer.param_groups:
        parts.append("|")  # a group boundary: the same tensors split otherwise is another optimizer setup
        for param in group["params"]:
            parts.append(f"{tuple(param.shape)}{param.dtype}{int(param.requires_grad)}")
            tensors += 1
            params += param.numel()
    digest = hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]
    return {"digest": digest, "params": params, "tensors": tensors, "optimizer": kind.__qualname__}


def report_model(optimizer: Any) -> None:
    """Write this process's ``model`` record. Never raises into the program's step."""
    try:
        fields = fingerprint(optimizer)
    except Exception as exc:  # an optimizer of a shape we cannot read: the run goes on, unfingerprinted
        channel.failed(f"model fingerprint: {type(exc).__name__}: {exc}")
        return
    channel.emit(protocol.MODEL, **fields)


_MARK = "_oomguard_save"


def _path(f: Any) -> str | None:
    """The file a save wrote, when it was named (a path); None for a file object or a buffer."""
    if isinstance(f, (str, os.PathLike)):
        return os.path.abspath(os.fsdecode(f))
    return None


def wrap_save(torch: Any, step: Callable[[], int | None], after: Callable[[], None]) -> None:
    """Wrap ``torch.save`` (once) to report each save with ``step()`` at its start (None before the
    process's first optimizer step, when a resumed count is not known yet); ``after()`` then runs
    (the memory breakdown's peak, probe/memory.py: a checkpoint is a cheap moment to say it)."""
    original = torch.save
    if getattr(original, _MARK, False):
        return
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if compiling():  # traced by dynamo (a save inside compiled code): the save alone, as without us
            return original(obj, f, *args, **kwargs)
        started, at = time.time(), step()
        result = original(obj, f, *args, **kwargs)  # its exception is the program's
        try:
            channel.emit(protocol.SAVE, path=_path(f), step=at, started=started)
            after()
        except Exception as exc:  # a bug of ours must not fail a save that succeeded
            channel.failed(f"save report: {type(exc).__name__}: {exc}")
        return result

    setattr(save, _MARK, True)
    torch.save = save
