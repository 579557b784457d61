"""The memory figures the probe reads (every record) and what filled memory, in the program's own
terms: weights, gradients, optimizer state, activations, cache (the ``memory`` record).

Tested in tests/unit/probe/test_memory.py, tests/e2e/test_memory_breakdown.py,
tests/e2e/test_probe_compile.py (the allocator's peaks) and, on a GPU (the CUDA split and the
allocator's snapshot), tests/e2e/test_memory_snapshot_gpu.py.

CUDA figures are read only where the program initialized CUDA itself (``torch.cuda.is_initialized``):
the probe never creates a CUDA context, which costs hundreds of MiB of device memory. What bounds a
CPU process is the address space when it runs under ``RLIMIT_AS`` (an allocation fails once its
mapped size would pass the limit, whatever is resident), else its resident memory (a cgroup's or
the host's limit, which the supervisor knows): ``host_bound`` names the one that applies.

At a memory failure the probe splits what the process held on the failing device into the parts a
user knows, each from torch's own objects (a ``memory`` record, at ``oom``):

- weights: the bytes of every parameter of every ``nn.Module`` alive, and of every parameter an
  optimizer holds (frozen: those with ``requires_grad`` False, a LoRA's base model, counted inside);
- gradients: the bytes of those parameters' ``.grad``;
- optimizer state: the bytes of every tensor in each optimizer's ``state`` (Adam's two moments and
  its step, SGD's momentum buffers);
- activations and temporaries: the rest. On CUDA, the allocator's allocated bytes less the three
  above; on the host, the process's memory (its address space under ``RLIMIT_AS``, else its resident
  set) less the ``baseline`` (what it held when ``import torch`` finished: the interpreter, torch's
  libraries, what the program imported before) and less the three above;
- the cache: CUDA's reserved less allocated (none on the host).

On CUDA the OOM observer reads the allocator before the error is raised. On the host the exception
hook reads the process once the error has unwound: tensors the failed expression held only as
temporaries (a list being built) are freed by then, so the host's activations at an OOM are a lower
bound of what was held at the failure, and the report says "at least".

Tensors are counted once per storage (tied weights, views) and only on the failing device. Modules
and optimizers are found by one walk of the garbage collector's objects, done only at a failure
(an OOM is rare and ends the process, or the program's own handler takes its time).

An attempt that fit says the same at its peak (``peak``), cheaply: weights, gradients and optimizer
state are read once, at the process's first optimizer step (its post hook: the step's gradients and
the optimizer's state exist then, before any ``zero_grad``), from that optimizer and the module its
forward ran (``ForwardTracker.root``); the peak is the allocator's (or the process's) own, read at exit
and at a checkpoint save. Nothing here runs inside a compiled region: the OOM observer, the
exception hooks, the optimizer post hook outside dynamo's trace, atexit and the save wrapper.

The CUDA allocator's own snapshot (``Snapshots``), in the attempt after one that met a CUDA OOM:
recording the history (``torch.cuda.memory._record_memory_history``) keeps a Python stack for every
allocation and costs time on each, so the first CUDA OOM only leaves ``memory/cuda-oom-attempt``
(its attempt number) in the run directory; the next attempt records from CUDA's own lazy
initialization, and its OOM saves ``torch.cuda.memory._snapshot()`` as
``memory/snapshot-attempt<N>-rank<R>.pickle`` (the file https://pytorch.org/memory_viz opens) and
names in its record the largest allocations alive by the program's own frame that made them.
``OOMGUARD_MEMORY_SNAPSHOT=off`` in oomguard's environment (the worker inherits it) turns it off.
"""

from __future__ import annotations

import gc
import os
import pickle
from collections.abc import Callable, Iterable
from typing import Any

from ..common import protocol
from . import channel

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


ADDRESS_SPACE, RSS, CUDA_ALLOCATED = "address_space", "rss", "cuda_allocated"  # the measures an oom record names


def statm() -> tuple[int, int] | None:
    """(mapped size, resident) in bytes from /proc/self/statm; None off Linux."""
    try:
        with open("/proc/self/statm", "rb") as f:
            size, resident = f.read().split()[:2]
        return int(size) * _PAGE, int(resident) * _PAGE
    except (OSError, ValueError):
        return None


def address_space_limit() -> int | None:
    """The soft ``RLIMIT_AS`` in bytes, or None when there is none."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    return soft if soft > 0 and soft != resource.RLIM_INFINITY else None


def status_bytes(key: bytes) -> int | None:
    """One ``kB`` figure of /proc/self/status in bytes (``VmPeak:``, the highest mapped size)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def held(torch: Any) -> dict[str, int]:
    """What the process holds now in each measure an OOM may be judged in (before a step's forward)."""
    figures: dict[str, int] = {}
    cuda = torch.cuda
    if cuda.is_initialized():
        figures[CUDA_ALLOCATED] = int(cuda.memory_allocated())
    both = statm()
    if both is not None:
        figures[ADDRESS_SPACE], figures[RSS] = both
    return figures


def host_bound() -> tuple[str, int | None, int | None]:
    """(measure, what this process holds in it now, its limit) for a host OOM: the address space
    under ``RLIMIT_AS``, else the resident memory with no limit the process itself can see."""
    both = statm()
    limit = address_space_limit()
    if limit is not None:
        return ADDRESS_SPACE, both[0] if both else None, limit
    return RSS, both[1] if both else None, None


def fraction(cuda: Any, index: int) -> float | None:
    """The per-process memory fraction set on a device (``set_per_process_memory_fraction``), or
    None when none is set or this torch cannot tell (the getter came in torch 2.5)."""
    get = getattr(cuda, "get_per_process_memory_fraction", None)
    if get is None:
        return None
    value = float(get(index))
    return value if 0 < value < 1 else None


def limit_bytes(cuda: Any, index: int) -> int:
    """What this process may allocate on a device: the fraction's cap, else the device's total."""
    total = int(cuda.get_device_properties(index).total_memory)
    share = fraction(cuda, index)
    return int(total * share) if share is not None else total


def device_peaks(torch: Any) -> dict[str, dict[str, int]]:
    """Per device this process allocated on: the allocator's peak allocated and reserved as the
    allocator reports them (since the process started, or since the program's own
    ``reset_peak_memory_stats``), and the limit. Never reset here: the program's own
    ``max_memory_allocated()`` and ``memory_stats()`` must read what they would without the probe."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return {}
    peaks: dict[str, dict[str, int]] = {}
    for index in range(cuda.device_count()):
        reserved = int(cuda.max_memory_reserved(index))
        if not reserved:
            continue  # a device this process never allocated on (another rank's)
        peaks[f"cuda:{index}"] = {"allocated_peak": int(cuda.max_memory_allocated(index)), "reserved_peak": reserved,
                                  "limit_bytes": limit_bytes(cuda, index)}
    return peaks


Baseline = tuple[int, int] | None  # (address space, resident) when torch finished importing


def _local(tensor: Any) -> Any:
    """This rank's own tensor: a DTensor (FSDP2, tensor parallel) holds its shard in ``_local_tensor``;
    its own storage is no real one ("invalid python storage")."""
    local = getattr(tensor, "_local_tensor", None)
    return local if local is not None else tensor


def _storage(tensor: Any) -> tuple[tuple[str, int] | None, int]:
    """One key per storage (a view or a tied weight counts once; None for a storage without memory)
    and its bytes; a tensor subclass without a storage of its own counts its own bytes, once each."""
    try:
        storage = tensor.untyped_storage()
        pointer, size = int(storage.data_ptr()), int(storage.nbytes())
    except RuntimeError:
        return ("subclass", id(tensor)), int(tensor.numel()) * int(tensor.element_size())
    return ((str(tensor.device), pointer) if pointer else None), size


class Counter:
    """Sums the bytes of distinct storages on one device."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seen: set[tuple[str, int]] = set()

    def add(self, tensors: Iterable[Any]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None or str(tensor.device) != self.device:
                continue
            key, size = _storage(_local(tensor))
            if key is None or key in self.seen:
                continue
            self.seen.add(key)
            total += size
        return total


def find(torch: Any, known: Iterable[Any] = ()) -> tuple[list[Any], list[Any]]:
    """Every ``nn.Module`` and ``Optimizer`` alive (``known`` optimizers included), by one walk of
    the garbage collector's objects: only at a failure, where a tenth of a second is nothing."""
    module_type, optimizer_type = torch.nn.Module, torch.optim.Optimizer
    modules: list[Any] = []
    optimizers: dict[int, Any] = {id(o): o for o in known}
    for obj in gc.get_objects():
        kind = type(obj)  # never isinstance: a proxy's __class__ may run code
        if issubclass(kind, module_type):
            modules.append(obj)
        elif issubclass(kind, optimizer_type):
            optimizers[id(obj)] = obj
    return modules, list(optimizers.values())


def _optimizer_params(optimizers: Iterable[Any]) -> list[Any]:
    return [p for o in optimizers for group in o.param_groups for p in group["params"]]


def _state_tensors(optimizer: Any, tensor_type: type) -> list[Any]:
    return [value for state in optimizer.state.values() if isinstance(state, dict)
            for value in state.values() if isinstance(value, tensor_type)]


def model_parts(torch: Any, device: str, modules: Iterable[Any], optimizers: list[Any]) -> dict[str, Any]:
    """weights, frozen_weights, gradients, optimizer_state (bytes on ``device``) and the optimizers' names."""
    params: dict[int, Any] = {}
    for module in modules:
        for param in module.parameters(recurse=False):
            params.setdefault(id(param), param)
    for param in _optimizer_params(optimizers):
        params.setdefault(id(param), param)
    weights, grads, state = Counter(device), Counter(device), Counter(device)
    frozen = Counter(device)
    trainable = [p for p in params.values() if p.requires_grad]
    frozen_bytes = frozen.add(p for p in params.values() if not p.requires_grad)
    weights.seen |= frozen.seen
    weight_bytes = weights.add(trainable) + frozen_bytes
    tensor = torch.Tensor
    return {"weights": weight_bytes, "frozen_weights": frozen_bytes,
            "gradients": grads.add(p.grad for p in params.values()),
            "optimizer_state": sum(state.add(_state_tensors(o, tensor)) for o in optimizers),
            "optimizers": sorted({type(o).__name__ for o in optimizers})}


def _fixed(parts: dict[str, Any]) -> int:
    return int(parts["weights"] + parts["gradients"] + parts["optimizer_state"])


def _rest(held: int | None, *less: int | None) -> int | None:
    """``held`` less the rest; None where one is unknown or the difference is negative (the measures
    did not match: no figure rather than a wrong one)."""
    if held is None or any(x is None for x in less):
        return None
    rest = held - sum(x for x in less if x is not None)
    return rest if rest >= 0 else None


def cuda_figures(cuda: Any, index: int, parts: dict[str, Any], allocated: int, reserved: int) -> dict[str, Any]:
    """The CUDA parts: activations are the allocator's allocated less the model's parts."""
    return {**parts, "device": f"cuda:{index}", "activations": _rest(allocated, _fixed(parts)),
            "cache": reserved - allocated, "total": reserved, "limit": limit_bytes(cuda, index),
            "limit_kind": "gpu", "measure": CUDA_ALLOCATED, "baseline": None}


def host_figures(parts: dict[str, Any], measure: str, held: int | None, limit: int | None,
                 baseline: Baseline) -> dict[str, Any]:
    """The host parts: activations are the process's memory less its baseline and the model's parts."""
    base = None if baseline is None else baseline[0] if measure == ADDRESS_SPACE else baseline[1]
    return {**parts, "device": "cpu", "activations": _rest(held, base, _fixed(parts)), "cache": None,
            "total": held, "limit": limit, "limit_kind": "RLIMIT_AS" if limit is not None else None,
            "measure": measure, "baseline": base}


def host_peak() -> tuple[str, int | None, int | None]:
    """(measure, the process's peak in it, its limit): the address space's peak under ``RLIMIT_AS``,
    else the resident set's high-water mark (``VmHWM``)."""
    limit = address_space_limit()
    if limit is not None:
        return ADDRESS_SPACE, status_bytes(b"VmPeak:"), limit
    return RSS, status_bytes(b"VmHWM:"), None


PEAK_EVERY = 10.0  # seconds between two peak records at saves (a save is rare; the record is small)


class BreakdownReporter:
    """Writes ``memory`` records: at an OOM (``at_cuda_oom``, ``at_host_oom``) and at the peak of a
    process that trained and met no OOM (``at_peak``: at exit and after a checkpoint save)."""

    def __init__(self, torch: Any, known: Any = lambda: [], root: Any = lambda: None) -> None:
        self._torch, self._known, self._root = torch, known, root
        self.baseline: Baseline = statm()  # torch has just finished importing: before the model
        self.first: dict[str, dict[str, Any]] = {}  # device -> the model's parts at the first optimizer step
        self.oom_seen = False
        self._next_peak = 0.0
        self.extra: Any = lambda device: {}  # more fields at a CUDA OOM (the snapshot's, ``Snapshots``)

    def forget(self) -> None:
        """In a forked child: it trains nothing of its parent's (a DataLoader worker)."""
        self.first, self.oom_seen = {}, False

    def at_peak_safely(self) -> None:
        """``at_peak`` for atexit and the save wrapper: a failure of ours is one ``probe`` record."""
        try:
            self.at_peak()
        except Exception as exc:
            channel.failed(f"memory breakdown at the peak: {type(exc).__name__}: {exc}")

    def at_first_step(self, optimizer: Any) -> None:
        """The process's first optimizer step (its post hook): the parts that do not follow the batch."""
        root = self._root()
        # The module its forward ran holds the frozen parameters too; compiled before any forward, the walk.
        modules = list(root.modules()) if root is not None else find(self._torch)[0]
        params = [*_optimizer_params([optimizer]), *(p for m in modules for p in m.parameters(recurse=False))]
        for device in sorted({str(p.device) for p in params}):
            self.first[device] = model_parts(self._torch, device, modules, [optimizer])

    def at_cuda_oom(self, index: int, requested: int) -> None:
        self.oom_seen = True
        cuda = self._torch.cuda
        modules, optimizers = find(self._torch, self._known())
        parts = model_parts(self._torch, f"cuda:{index}", modules, optimizers)
        figures = cuda_figures(cuda, index, parts, int(cuda.memory_allocated(index)), int(cuda.memory_reserved(index)))
        try:
            more = self.extra(index)
        except Exception as exc:  # the snapshot failed (a full disk): the breakdown goes without it
            more = {}
            channel.failed(f"allocator snapshot at a CUDA OOM: {type(exc).__name__}: {exc}")
        self._emit("oom", figures, requested=requested, **more)

    def at_host_oom(self, requested: int | None, measure: str, held: int | None, limit: int | None) -> None:
        self.oom_seen = True
        modules, optimizers = find(self._torch, self._known())
        parts = model_parts(self._torch, "cpu", modules, optimizers)
        self._emit("oom", host_figures(parts, measure, held, limit, self.baseline), requested=requested)

    def at_peak(self, now: float | None = None) -> None:
        """The allocator's (or the process's) peak, split with the parts read at the first step."""
        if self.oom_seen or not self.first or (now is not None and now < self._next_peak):
            return
        self._next_peak = (now or 0.0) + PEAK_EVERY
        cuda = self._torch.cuda
        for device, parts in self.first.items():
            if device.startswith("cuda:") and cuda.is_initialized():
                index = int(device.split(":", 1)[1])
                figures = cuda_figures(cuda, index, parts, int(cuda.max_memory_allocated(index)),
                                       int(cuda.max_memory_reserved(index)))
            elif device == "cpu":
                figures = host_figures(parts, *host_peak(), self.baseline)
            else:
                continue
            self._emit("peak", figures)

    def _emit(self, at: str, figures: dict[str, Any], **more: Any) -> None:
        channel.emit(protocol.MEMORY, at=at, micro_batch=channel.env_int(protocol.ENV_MICRO_BATCH),
                     **figures, **more)


ENV_SWITCH = "OOMGUARD_MEMORY_SNAPSHOT"
MARKER = "cuda-oom-attempt"
MAX_ENTRIES = 100_000  # allocation events kept: the memory viewer's default scale, a few MB of host memory
TOP = 5


def _off() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "no", "false")


def _folder() -> str | None:
    run_dir = os.environ.get(protocol.ENV_RUN_DIR)
    return os.path.join(run_dir, "memory") if run_dir else None


def armed(folder: str | None, attempt: int | None) -> bool:
    """Whether this attempt follows one that met a CUDA OOM (its marker names attempt - 1)."""
    if folder is None or attempt is None or _off():
        return False
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return int(f.read().strip() or -1) == attempt - 1
    except (OSError, ValueError):
        return False


def where(frames: list[dict[str, Any]]) -> str | None:
    """The program's own frame that made an allocation: the innermost one outside torch."""
    for frame in frames:
        name = str(frame.get("filename", ""))
        if name and not name.startswith("<") and f"{os.sep}torch{os.sep}" not in name:
            return f"{name}:{frame.get('line')} in {frame.get('name')}"
    return None


def largest(snapshot: dict[str, Any], top: int = TOP) -> list[dict[str, Any]]:
    """The allocations alive in ``snapshot``, summed by the program's frame that made them, largest first."""
    sums: dict[str, list[int]] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            key = where(block.get("frames") or []) or "no Python frame recorded"
            entry = sums.setdefault(key, [0, 0])
            entry[0] += int(block.get("requested_size") or block.get("size") or 0)
            entry[1] += 1
    ranked = sorted(sums.items(), key=lambda item: -item[1][0])[:top]
    return [{"where": key, "bytes": size, "allocations": count} for key, (size, count) in ranked]


class Snapshots:
    """What a CUDA OOM adds to its ``memory`` record (``at_oom``), and the recording behind it."""

    def __init__(self, torch: Any, folder: str | None, attempt: int | None) -> None:
        self._torch, self.folder, self.attempt = torch, folder, attempt
        self.recording = False

    def start(self) -> None:
        """At CUDA's lazy initialization: record the history (Python stacks only: the cheaper kind)."""
        try:
            self._torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
            self.recording = True
        except Exception as exc:
            channel.failed(f"allocator history not recorded: {type(exc).__name__}: {exc}")

    def at_oom(self, index: int) -> dict[str, Any]:
        if self.folder is None or _off():
            return {}
        os.makedirs(self.folder, exist_ok=True)
        if not self.recording:
            _write(os.path.join(self.folder, MARKER), f"{self.attempt}\n".encode())
            return {"snapshot": None}
        snapshot = self._torch.cuda.memory._snapshot()
        rank = channel.env_int("RANK") or 0
        path = os.path.join(self.folder, f"snapshot-attempt{self.attempt}-rank{rank}.pickle")
        _write(path, pickle.dumps(snapshot))
        return {"snapshot": path, "stacks": largest(snapshot)}


def _write(path: str, data: bytes) -> None:
    """Atomically: a reader never opens half a pickle."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


def install_snapshots(torch: Any) -> Callable[[int], dict[str, Any]]:
    """Record the history from CUDA's initialization where this attempt follows a CUDA OOM; returns
    what an OOM adds to its record."""
    snapshots = Snapshots(torch, _folder(), channel.env_int(protocol.ENV_ATTEMPT))
    if armed(snapshots.folder, snapshots.attempt):
        torch.cuda._lazy_call(snapshots.start)
    return snapshots.at_oom
