"""Telling a recoverable out-of-memory error from a fatal one, and giving the memory back.

A device OOM (``torch.OutOfMemoryError``, or a library's text in ``oomtexts``) and a host allocator
failure (PyTorch's ``DefaultCPUAllocator``, or Python's ``MemoryError``) leave the process
usable: drop the failed step's tensors and retry smaller. Errors that poison the CUDA context
(illegal memory access, device-side assert) do not: every later CUDA call fails, so the only
remedy is a new process, which the supervisor provides.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import traceback
from types import TracebackType

import torch

from oomguard.worker import oomtexts, protocol

CUDA_OOM = "cuda_oom"
HOST_OOM = "host_oom"
CUDA_FATAL = "cuda_fatal"
CRASH = "crash"

# Texts of errors after which the CUDA context is unusable (sticky errors in CUDA's terms). The
# error's own words: every CUDA error torch raises ends "Compile with `TORCH_USE_CUDA_DSA` to enable
# device-side assertions.", an out-of-memory one included, so "device-side assert" alone is no mark.
_FATAL_MARKERS = (
    "illegal memory access",
    "device-side assert triggered",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
    "uncorrectable ECC error",
    "CUDA error: unknown error",
)


def classify(exc: BaseException) -> str | None:
    """The protocol failure kind of ``exc``, or None when it is not a memory or CUDA failure."""
    if isinstance(exc, torch.OutOfMemoryError):
        return CUDA_OOM
    if isinstance(exc, MemoryError):
        return HOST_OOM
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    # Fatal first: an OOM reported after an illegal access is still an unusable context.
    if any(marker in text for marker in _FATAL_MARKERS):
        return CUDA_FATAL
    if oomtexts.DEVICE_OOM.search(text):  # cuBLAS/cuDNN workspaces, HIP, MPS, XPU, NCCL: the context lives on
        return CUDA_OOM
    if oomtexts.HOST_OOM.search(text):
        return HOST_OOM
    return None


def is_recoverable(kind: str | None) -> bool:
    return kind in (CUDA_OOM, HOST_OOM)


def poisons_communicator(exc: BaseException) -> bool:
    """An out-of-memory NCCL reported (``Cuda failure 'out of memory'``): a memory failure the
    supervisor halves for, but the communicator that raised it is aborted, so a retry in this
    process would wait in the next collective forever. Only a new process recovers."""
    return "NCCL" in str(exc) or "Cuda failure" in str(exc)


def drop_frames(tb: TracebackType | None) -> None:
    """Clear the locals of every frame in ``tb``.

    The traceback of an OOM raised deep in forward holds the frames of every module on the way,
    and their locals are the activations that filled the memory. Anything that keeps the
    exception (a logger, ``sys.last_traceback``, a debugger) would keep them alive too.
    """
    if tb is not None:
        traceback.clear_frames(tb)


def summarize(exc: BaseException, limit: int = 2000) -> str:
    """A one-record message: the exception type and its text, bounded for the event channel."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def release_memory() -> None:
    """Return freed memory to the device and the OS once the failed step's references are gone."""
    # The young generations only: with the traceback's frames cleared (drop_frames) the step's
    # tensors are freed by reference counting already, and what cycles the failed step made are
    # new objects. A full collection costs ~100 ms once torch has loaded torch._dynamo.
    gc.collect(1)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _malloc_trim()


def _malloc_trim() -> None:
    # glibc keeps freed small-block arenas mapped; trimming them makes RSS (the only memory
    # figure the host has) come back to its baseline, which growing back relies on.
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return  # not glibc (musl, macOS): nothing to trim
    trim(0)


def failure_record(kind: str, message: str, micro_batch: int | None, **fields: object) -> bool:
    """Tell the supervisor about a failure; False when no supervisor listens."""
    return protocol.emit(protocol.FAILURE, kind=kind, message=message, micro_batch=micro_batch, **fields)
