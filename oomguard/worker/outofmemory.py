"""Telling a recoverable out-of-memory error from a fatal one, and giving the memory back.

A device OOM (``torch.OutOfMemoryError``, or a library's text in ``oomtexts``) and a host allocator
failure (PyTorch's ``DefaultCPUAllocator``, or Python's ``MemoryError``) leave the process
usable: drop the failed step's tensors and retry smaller. Errors that poison the CUDA context
(illegal memory access, device-side assert) do not: every later CUDA call fails, so the only
remedy is a new process, which the supervisor provides.

Also here:

- The micro-batch: shrink on OOM, grow back when it fits (``Tuner``), always by an exact divisor of
  the per-process batch, which never changes; pure code, tested alone.
- Measuring a step's peak memory and the room left, on a CUDA device or on the host.
- Data-parallel ranks agree on an OOM before any collective that could hang.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from oomguard.common import oomtexts
from oomguard.common.batch import divisors, largest_divisor_at_most

CUDA_OOM = "cuda_oom"
HOST_OOM = "host_oom"
CUDA_FATAL = "cuda_fatal"

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


# Measuring a step's peak memory and the room left, on a CUDA device or on the host.
#
# Growing back needs two numbers: how many bytes one more sample costs (the step's peak above
# what was in use before it, divided by the micro-batch) and how many bytes are still available.
# On CUDA they come from the caching allocator. On the host, the peak is the resident-set high
# water mark (``VmHWM``), which Linux lets a process reset by writing ``5`` to
# ``/proc/self/clear_refs``; the room is the tightest of ``RLIMIT_AS``, the memory cgroup's limit
# and ``MemAvailable``.


def shrink(per_process: int, failed: int, floor: int = 1) -> int | None:
    """Largest divisor of ``per_process`` at most half of ``failed`` and at least ``floor``."""
    return largest_divisor_at_most(per_process, failed // 2, floor)


def grow(per_process: int, current: int, banned: set[int]) -> int | None:
    """Smallest divisor of ``per_process`` above ``current`` not yet failed."""
    return next((d for d in divisors(per_process) if d > current and d not in banned), None)


@dataclass
class BatchDecision:
    """What the tuner wants after an event: a new micro-batch and why (protocol ``reason``)."""

    micro_batch: int
    reason: str


@dataclass
class Tuner:
    """The micro-batch state of one process.

    Lifecycle: ``current`` starts at the configured size; an OOM shrinks it (``oom``) or, during a
    trial of a larger size, reverts to the last stable one (``grow_failed``); after
    ``grow_after`` stable steps, a larger size that the memory model predicts to fit under
    ``margin`` is tried (``grow``). A size that ever failed is never tried again.
    """

    per_process: int
    current: int
    floor: int = 1
    grow_after: int | None = 50
    margin: float = 0.15
    failed: set[int] = field(default_factory=set)
    stable: int | None = None  # last size that completed a step; None before the first
    trial: bool = False
    stable_steps: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.current <= self.per_process:
            raise ValueError(
                f"micro_batch={self.current} must be between 1 and the per-process batch {self.per_process}"
            )

    @property
    def grad_accum(self) -> int:
        # A starting size that does not divide the batch gives a shorter last micro-batch.
        return -(-self.per_process // self.current)

    def on_oom(self) -> BatchDecision | None:
        """The size to retry at after an OOM, or None when nothing smaller is allowed."""
        self.failed.add(self.current)
        self.stable_steps = 0
        if self.trial and self.stable is not None:
            return self._switch(self.stable, "grow_failed", trial=False)
        smaller = shrink(self.per_process, self.current, self.floor)
        return None if smaller is None else self._switch(smaller, "oom", trial=False)

    def on_success(self, bytes_per_sample: float | None, headroom: float | None) -> BatchDecision | None:
        """Count a completed step; maybe propose a larger size that the memory model says fits."""
        self.stable, self.trial = self.current, False
        self.stable_steps += 1
        if self.grow_after is None or self.stable_steps < self.grow_after:
            return None
        candidate = grow(self.per_process, self.current, self.failed)
        if candidate is None or not self._fits(candidate, bytes_per_sample, headroom):
            return None
        return self._switch(candidate, "grow", trial=True)

    def _fits(self, candidate: int, bytes_per_sample: float | None, headroom: float | None) -> bool:
        if bytes_per_sample is None or headroom is None:
            return False  # no measurement, no gamble
        return bytes_per_sample * candidate <= (1.0 - self.margin) * headroom

    def _switch(self, size: int, reason: str, *, trial: bool) -> BatchDecision:
        self.current, self.trial, self.stable_steps = size, trial, 0
        return BatchDecision(size, reason)

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.stable or self.current, "failed": sorted(self.failed)}

    def load_failed(self, failed: Sequence[int]) -> None:
        self.failed.update(int(f) for f in failed)


class MemoryProbe:
    """Peak-per-step and headroom for the device that trains (``cuda`` or ``cpu``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self._before = 0

    def start_step(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            _reset_rss_peak()
            self._before = _status_kib("VmRSS") * 1024

    def step_peak(self) -> int:
        """Peak bytes in use during the step just finished (absolute, not above baseline)."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return _status_kib("VmHWM") * 1024

    def bytes_above_start(self) -> int:
        return max(0, self.step_peak() - self._before)

    def headroom(self) -> int | None:
        """Bytes that may still be allocated before the next OOM, or None when unknown."""
        if self.cuda:
            return _cuda_headroom(self.device)
        return _host_headroom()

    def rss(self) -> int:
        return _status_kib("VmRSS") * 1024


def _cuda_headroom(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    room = free + reserved - allocated
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        room = min(room, int(total * fraction(device)) - allocated)
    return room


def _host_headroom() -> int | None:
    rooms: list[int] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        rooms.append(soft - _status_kib("VmSize") * 1024)
    cgroup = _cgroup_room()
    if cgroup is not None:
        rooms.append(cgroup)
    available = _meminfo_kib("MemAvailable")
    if available is not None:
        rooms.append(available * 1024)
    return min(rooms) if rooms else None


def _cgroup_room() -> int | None:
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        base = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        current = int((base / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None
    return None if limit == "max" else int(limit) - current


def _reset_rss_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or a kernel without the reset: the peak then only ever rises


def _status_kib(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass  # no procfs: report 0, which disables growing back on this host
    return 0


def _meminfo_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


# Data-parallel ranks agree on an OOM before any collective that could hang.
#
# Under DistributedDataParallel the gradient all-reduce runs inside the backward of the last
# micro-batch. If one rank runs out of memory earlier in the step, the others reach that
# all-reduce and wait for a peer that will never come. So, as Composer does, a session under DDP
# computes every micro-batch with DDP's gradient sync off (``no_sync``), then all-reduces one flag
# per step, "did any rank hit an OOM?", and only when no rank did, averages the gradients itself
# (one flat all-reduce, the same mean DDP takes) before the optimizer step. A rank whose step hit
# an OOM takes part in that same all-reduce from its recovery path, so every rank learns of it
# at the same collective and redoes the step at the same smaller micro-batch.
#
# Needs a model wrapped in DDP with ``broadcast_buffers=False`` when it has buffers: DDP would
# otherwise broadcast them in every forward, a collective a failing rank never reaches.


PEER_OOM = "peer_oom"  # the step's OOM happened on another rank


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this step; this one redoes it with them."""


class RankAgreement:
    """The collectives a session uses to keep its ranks in step; one per session under DDP."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.world = dist.get_world_size()
        on_gpu = dist.get_backend() == "nccl"
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = device if on_gpu else torch.device("cpu")

    @staticmethod
    def of(model: torch.nn.Module) -> RankAgreement | None:
        """Agreement for a DDP-wrapped model in an initialized process group of several ranks."""
        # DDP only: FSDP also has no_sync(), but its gradients are sharded, not replicated
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if not ddp or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size() < 2:
            return None
        if getattr(model, "broadcast_buffers", False) and any(True for _ in model.buffers()):
            raise ValueError("Session under DDP needs DistributedDataParallel(..., broadcast_buffers=False): "
                             "a buffer broadcast in forward would hang when another rank hits an OOM")
        return RankAgreement(model)

    def any_oom(self, mine: bool) -> bool:
        """All-reduce (MAX) of this rank's OOM flag: True when any rank hit one in this step."""
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def smallest(self, value: int) -> int:
        """All-reduce (MIN): the micro-batch every rank can run."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def settle(self) -> None:
        """After the step's micro-batches: raise PeerOutOfMemory if a peer failed, else average the
        gradients over the ranks (what DDP's reducer would have done)."""
        if self.any_oom(False):
            raise PeerOutOfMemory("another rank ran out of memory in this step")
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            n = grad.numel()
            param.grad = flat[offset:offset + n].view_as(grad).clone()
            offset += n
