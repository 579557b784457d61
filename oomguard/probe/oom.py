"""The figures at an out-of-memory failure, in the allocator's words.

Tested in tests/unit/probe/test_steps.py and tests/e2e/test_probe.py (real out-of-memory errors).

CUDA: PyTorch's OOM observer (``torch._C._cuda_attach_out_of_memory_observer``, the hook its
memory-snapshot documentation uses) is called by the caching allocator when an allocation fails,
with the bytes requested and the device's free memory, before the OutOfMemoryError is raised. It
is attached through ``torch.cuda._lazy_call``: at CUDA's own lazy initialization, so the probe never
initializes CUDA. CPU: the allocator has no observer; an uncaught out-of-memory exception (torch's
``DefaultCPUAllocator: can't allocate memory`` RuntimeError, torch.OutOfMemoryError, MemoryError)
is seen by a chained ``sys.excepthook`` and ``threading.excepthook``, which then call the previous one.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..common import protocol
from . import channel, memory
from .forward import ForwardTracker
from .memory import BreakdownReporter

_CPU_REQUEST = re.compile(r"DefaultCPUAllocator: [^:]*: you tried to allocate (\d+) bytes")
_CUDA_WORDS = ("CUDA out of memory", "CUDA error: out of memory")


def cpu_oom_request(exc: BaseException, oom_type: type | None) -> tuple[bool, int | None]:
    """Whether ``exc`` is a host out-of-memory failure, and the bytes torch says it asked for."""
    text = str(exc)
    if any(words in text for words in _CUDA_WORDS):
        return False, None  # a CUDA OOM: the observer reported it with the allocator's figures
    found = _CPU_REQUEST.search(text)
    if found:
        return True, int(found.group(1))
    is_oom = isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type))
    return is_oom, None


class OomReporter:
    """Writes ``oom`` records; ``step`` reads the step reached (the step counter's)."""

    def __init__(self, torch: Any, step: Callable[[], int], forward: ForwardTracker | None = None,
                 breakdown: BreakdownReporter | None = None) -> None:
        self._torch, self._step, self._forward, self._breakdown = torch, step, forward, breakdown

    def on_cuda_oom(self, device: int, requested: int, device_total: int, device_free: int) -> None:
        """The allocator's OOM observer; called without its lock, before the error is raised."""
        try:
            cuda = self._torch.cuda
            self._emit(f"cuda:{device}", requested, memory.CUDA_ALLOCATED,
                       allocated_bytes=int(cuda.memory_allocated(device)),
                       reserved_bytes=int(cuda.memory_reserved(device)), free_bytes=int(device_free),
                       total_bytes=int(cuda.get_device_properties(device).total_memory),
                       fraction=memory.fraction(cuda, device))
        except Exception as exc:  # inside the allocator's failure path: never add a second error
            channel.failed(f"OOM observer: {type(exc).__name__}: {exc}")
        if self._breakdown is not None:
            try:
                self._breakdown.at_cuda_oom(device, int(requested))
            except Exception as exc:
                channel.failed(f"memory breakdown at a CUDA OOM: {type(exc).__name__}: {exc}")

    def on_exception(self, exc: BaseException | None) -> None:
        try:
            if exc is None:
                return
            is_oom, requested = cpu_oom_request(exc, getattr(self._torch, "OutOfMemoryError", None))
            if is_oom:
                # What bounds the process (the address space under RLIMIT_AS), read while the traceback
                # still holds the failed forward's tensors.
                measure, held, limit = memory.host_bound()
                self._emit("cpu", requested, measure, allocated_bytes=held, reserved_bytes=None, free_bytes=None,
                           total_bytes=limit, fraction=None)
                if self._breakdown is not None:
                    self._breakdown.at_host_oom(requested, measure, held, limit)
        except Exception as error:  # the program is ending with its own error: do not mask it
            channel.failed(f"exception hook: {type(error).__name__}: {error}")

    def _emit(self, device: str, requested: int | None, measure: str, **figures: Any) -> None:
        """``measure`` names what ``allocated_bytes``, ``total_bytes`` and the fixed memory count."""
        progress = self._forward.figures(measure) if self._forward is not None else {}
        channel.emit(protocol.OOM, device=device, step=self._step(), requested_bytes=requested,
                     micro_batch=channel.env_int(protocol.ENV_MICRO_BATCH), memory=measure, **figures, **progress)

    def attach(self) -> None:
        """The CUDA observer at CUDA's initialization (never forcing it), the exception hooks now."""
        self._torch.cuda._lazy_call(self._attach_cuda)
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
            self.on_exception(exc)
            previous(kind, exc, tb)

        sys.excepthook = excepthook
        previous_thread = threading.excepthook

        def thread_excepthook(args: Any) -> None:
            self.on_exception(args.exc_value)
            previous_thread(args)

        threading.excepthook = thread_excepthook

    def _attach_cuda(self) -> None:
        # Run inside torch.cuda's lazy init: an exception here would fail the program's first CUDA call.
        try:
            self._torch._C._cuda_attach_out_of_memory_observer(self.on_cuda_oom)
        except Exception as exc:
            channel.failed(f"OOM observer not attached: {type(exc).__name__}: {exc}")
