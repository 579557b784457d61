"""The training session: owns the optimizer step and survives OOMs inside the process.

A step takes one global batch (this process's share of it), splits it into micro-batches,
weights each micro-batch's mean loss by its share of samples (so an uneven last micro-batch is
exact), accumulates gradients and steps the optimizer, the GradScaler and the scheduler. On an
OOM anywhere in the step it drops the step's tensors, restores the random streams to the start
of the step and retries the same global batch at a smaller micro-batch: no optimizer step and no
sample is lost or repeated. After enough stable steps it tries a larger micro-batch when the
measured memory per sample says it fits. At step boundaries it checkpoints on a schedule, on the
supervisor's request and on SIGTERM.

It talks to the supervisor through ``common/protocol.py``: progress, heartbeats, batch changes,
checkpoints and failures out (``Channel``: a no-op without a supervisor); a checkpoint request (the
signal ``OOMGUARD_CHECKPOINT_SIGNAL`` and/or the file ``OOMGUARD_CHECKPOINT_REQUEST``) and a stop
(SIGTERM, SIGINT) in (``Requests``): signal handlers only set flags, acted on at a step boundary.

Lifecycle: ``start()`` (or ``with``) resumes from a checkpoint and installs signal handlers;
``step()`` as often as needed (``batches()`` draws the data); ``close()`` writes the final
checkpoint. Without a supervisor every ``OOMGUARD_*`` variable is simply absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn, Protocol

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state
from torch.utils.data import Dataset

from oomguard.common import protocol
from oomguard.common.batch import divisors
from oomguard.worker import checkpoint
from oomguard.worker import outofmemory as oom
from oomguard.worker.data import ResumableSampler, batch_size, draw, slice_batch, split_sizes
from oomguard.worker.outofmemory import BatchDecision, MemoryProbe, Tuner

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class Channel:
    """Records for the supervisor, with progress rate-limited and heartbeats in between."""

    def __init__(self, progress_every_s: float = 1.0, heartbeat_every_s: float = 10.0) -> None:
        self.progress_every_s = progress_every_s
        self.heartbeat_every_s = heartbeat_every_s
        self._last_progress = float("-inf")
        self._last_record = time.monotonic()

    def progress(self, step: int, *, force: bool = False, **fields: Any) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= self.progress_every_s:
            self._emit(protocol.PROGRESS, step=step, **fields)
            self._last_progress = now

    def heartbeat(self, step: int) -> None:
        """Called inside long steps (per micro-batch) so a slow step is not taken for a hang."""
        if time.monotonic() - self._last_record >= self.heartbeat_every_s:
            self._emit(protocol.HEARTBEAT, step=step)

    def batch(self, micro_batch: int, grad_accum: int, reason: str, **fields: Any) -> None:
        self._emit(protocol.BATCH, micro_batch=micro_batch, grad_accum=grad_accum, reason=reason, **fields)

    def checkpoint(self, path: str, step: int) -> None:
        self._emit(protocol.CHECKPOINT, path=path, step=step)

    def failure(self, kind: str, message: str, micro_batch: int | None, **fields: Any) -> None:
        self._emit(protocol.FAILURE, kind=kind, message=message, micro_batch=micro_batch, **fields)

    def _emit(self, record_type: str, **fields: Any) -> None:
        protocol.emit(record_type, **fields)
        self._last_record = time.monotonic()


class Requests:
    """Flags set by signals, read at step boundaries; installs and later restores the handlers."""

    def __init__(self) -> None:
        self.stop_signal: int | None = None
        self._checkpoint_flag = False
        self.request_file = os.environ.get(protocol.ENV_CHECKPOINT_REQUEST) or None
        self._checkpoint_signal = protocol.signal_number(os.environ.get(protocol.ENV_CHECKPOINT_SIGNAL, ""))
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Install the handlers (main thread only; elsewhere Python forbids it and we poll the file)."""
        wanted: dict[int, Any] = {signal.SIGTERM: self._on_stop, signal.SIGINT: self._on_stop}
        if self._checkpoint_signal is not None:
            wanted[self._checkpoint_signal] = self._on_checkpoint
        for signum, handler in wanted.items():
            try:
                self._previous[signum] = signal.signal(signum, handler)
            except ValueError:
                return  # not the main thread

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def checkpoint_wanted(self) -> bool:
        # The file is checked too: it survives a signal that arrived before the handler existed.
        return self._checkpoint_flag or (self.request_file is not None and os.path.exists(self.request_file))

    def checkpoint_done(self) -> None:
        self._checkpoint_flag = False
        if self.request_file is not None:
            Path(self.request_file).unlink(missing_ok=True)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is not None:
            # A second SIGTERM/SIGINT means "now": do not wait for the step to end. Checkpoints
            # are atomic, so dying mid-write loses nothing but the write.
            os._exit(128 + signum)
        self.stop_signal = signum

    def _on_checkpoint(self, signum: int, frame: FrameType | None) -> None:
        self._checkpoint_flag = True


class OutOfMemoryAbort(RuntimeError):
    """An OOM the session will not absorb: at the smallest micro-batch, in-process recovery off,
    or an optimizer step the OOM left half-applied. The message keeps the original error text so
    the supervisor's output scan classifies the exit too."""


@dataclass(frozen=True)
class SessionConfig:
    """Everything a session needs besides the model; ``OOMGUARD_*`` variables override the batch
    fields (the supervisor decides them) and name the checkpoint to resume from."""

    global_batch: int | None = None  # samples per optimizer step over all processes
    micro_batch: int | None = None  # starting micro-batch; default the whole per-process batch
    world_size: int = 1
    rank: int = 0
    min_micro_batch: int = 1
    total_steps: int | None = None  # batches() stops here
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # steps; None = only on request, on stop and at the end
    keep_last: int = 3
    async_save: bool = False
    resume: bool = True  # resume from the newest complete checkpoint in checkpoint_dir
    recover_in_process: bool = True
    grow_after: int | None = 50  # stable steps before trying a larger micro-batch; None = never
    grow_margin: float = 0.15
    max_grad_norm: float | None = None
    seed: int = 0  # data order of batches()
    shuffle: bool = True
    progress_every_s: float = 1.0
    heartbeat_every_s: float = 10.0
    fingerprint_extra: str = ""  # anything else a checkpoint must match (e.g. model config)

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "total_steps", "checkpoint_every", "grow_after"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"SessionConfig.{name} must be a positive integer or None, got {value}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"SessionConfig: rank {self.rank} is not in a world of {self.world_size}")
        if not 0.0 <= self.grow_margin < 1.0:
            raise ValueError(f"SessionConfig.grow_margin must be in [0, 1), got {self.grow_margin}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("SessionConfig.checkpoint_every needs checkpoint_dir")


@dataclass(frozen=True)
class StepResult:
    step: int  # optimizer steps done, this one included
    loss: float  # mean loss over the per-process batch, exactly weighted
    micro_batch: int  # the size that completed the step
    grad_accum: int
    ooms: int  # OOMs absorbed during this step
    seconds: float


class Session:
    """Owns the optimizer step of one training process; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: SessionConfig | None = None,
        *,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        stateful: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.config = config or SessionConfig()
        self.scheduler, self.scaler = scheduler, scaler
        self.stateful = dict(stateful or {})
        self.global_batch, self.world_size = _resolve_global(self.config)
        self.per_process = self.global_batch // self.world_size
        self.tuner = Tuner(per_process=self.per_process, current=_resolve_micro(self.config, self.per_process),
                           floor=self.config.min_micro_batch, grow_after=self.config.grow_after,
                           margin=self.config.grow_margin)
        self.step_count = 0
        self.samples = 0  # samples (all processes) consumed by completed optimizer steps
        self.fingerprint = _fingerprint(self)
        self.channel = Channel(self.config.progress_every_s, self.config.heartbeat_every_s)
        self.requests = Requests()
        self.probe = MemoryProbe(_device_of(model))
        directory = self.config.checkpoint_dir
        self.store = checkpoint.CheckpointStore(directory, self.config.keep_last) if directory else None
        self.writer = checkpoint.AsyncWriter(self.store) if self.store else None
        self._saved_step = -1
        self._phase = "idle"
        self._versions: list[int] = []
        self._started = False
        self._ranks: oom.RankAgreement | None = None  # under DDP: the OOM flag and gradient averaging

    # ----- lifecycle

    @property
    def micro_batch(self) -> int:
        return self.tuner.current

    @property
    def grad_accum(self) -> int:
        return self.tuner.grad_accum

    @property
    def finished(self) -> bool:
        return self.config.total_steps is not None and self.step_count >= self.config.total_steps

    def start(self) -> int:
        """Resume (when a checkpoint exists), install signal handlers; returns the step to go on from."""
        if not self._started:
            self._started = True
            self._ranks = oom.RankAgreement.of(self.model)
            self.requests.install()
            self.resume()
        return self.step_count

    def __enter__(self) -> Session:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(final_checkpoint=exc_type is None)

    def close(self, final_checkpoint: bool = True) -> None:
        """Write the last checkpoint (unless told not to), wait for writes, restore signal handlers."""
        try:
            if final_checkpoint and self.store is not None and self._saved_step != self.step_count:
                self.save(sync=True)
            self._flush_writes()
        finally:
            self.requests.uninstall()

    # ----- resume

    def resume(self, path: str | os.PathLike[str] | None = None) -> int:
        """Load ``path``, else the supervisor's ``OOMGUARD_CHECKPOINT``, else the newest in checkpoint_dir."""
        chosen = path or os.environ.get(protocol.ENV_CHECKPOINT) or self._latest()
        if not chosen:
            return self.step_count
        state = checkpoint.load(chosen, self.fingerprint)
        self.load_state_dict(state)
        self.channel.batch(
            self.micro_batch, self.grad_accum, "resume", step=self.step_count, checkpoint=str(chosen)
        )
        return self.step_count

    def _latest(self) -> str | None:
        if self.store is None or not self.config.resume:
            return None
        self.store.clean_stale()
        latest = self.store.latest()
        return str(latest.path) if latest else None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: weights, optimizer, RNG, data position, tuning."""
        return {
            "format": 1,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": checkpoint.capture(),
            "stateful": {name: obj.state_dict() for name, obj in self.stateful.items()},
            "session": {
                "step": self.step_count,
                "samples": self.samples,
                "micro_batch": self.tuner.state_dict()["current"],
                "failed_micro_batches": sorted(self.tuner.failed),
                "global_batch": self.global_batch,
                "world_size": self.world_size,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        for name, obj in self.stateful.items():
            obj.load_state_dict(state["stateful"][name])
        checkpoint.restore(state["rng"])
        session = state["session"]
        self.step_count, self.samples = int(session["step"]), int(session["samples"])
        self._saved_step = self.step_count
        self.tuner.load_failed(session["failed_micro_batches"])
        # The supervisor's choice wins; without one, continue at the size this run tuned.
        if not os.environ.get(protocol.ENV_MICRO_BATCH) and not os.environ.get(protocol.ENV_GRAD_ACCUM):
            self.tuner.current = int(session["micro_batch"])

    # ----- data

    def batches(
        self,
        dataset: Dataset[Any],
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
    ) -> Iterator[Any]:
        """This process's batch for each coming step, from where the run stands, until total_steps."""
        sampler = ResumableSampler(
            len(dataset),  # type: ignore[arg-type]
            seed=self.config.seed,
            shuffle=self.config.shuffle,
            position=self.samples,
        )
        stream = draw(
            dataset,
            sampler,
            self.global_batch,
            rank=self.config.rank,
            world_size=self.world_size,
            collate_fn=collate_fn,
            num_workers=num_workers,
        )
        while not self.finished:
            yield next(stream)

    # ----- the step

    def step(self, batch: Any) -> StepResult:
        """One optimizer step over ``batch`` (this process's share of the global batch)."""
        if not self._started:
            self.start()
        size = batch_size(batch)
        if size != self.per_process:
            raise ValueError(f"step() got {size} samples; this process's batch is {self.per_process}")
        began, ooms = time.monotonic(), 0
        at_start = checkpoint.capture()
        while (loss := self._attempt(batch, at_start)) is None:
            ooms += 1
        self.step_count += 1
        self.samples += self.global_batch
        seconds = time.monotonic() - began
        result = StepResult(self.step_count, loss, self.micro_batch, self.grad_accum, ooms, seconds)
        self._after_step(result)
        return result

    def _attempt(self, batch: Any, at_start: dict[str, Any]) -> float | None:
        """The step's loss, or None after an absorbed OOM (memory freed, RNG rewound)."""
        self.probe.start_step()
        try:
            return self._accumulate_and_step(batch)
        except Exception as exc:  # narrowed by classify(); anything else propagates unchanged
            kind = oom.PEER_OOM if isinstance(exc, oom.PeerOutOfMemory) else oom.classify(exc)
            if kind is None:
                raise
            if kind == oom.CUDA_FATAL or (kind == oom.CUDA_OOM and oom.poisons_communicator(exc)):
                self._die(kind, exc)
            message, phase = oom.summarize(exc), self._phase
            oom.drop_frames(exc.__traceback__)
            torn = phase == "optimizer" and self._optimizer_touched()
        # Out of the except block, so the exception and its frames (the activations) are gone.
        if self._ranks is not None and kind != oom.PEER_OOM:
            # The peers meet us at settle()'s flag; past it (optimizer) they are already stepping.
            torn = torn or phase not in ("forward", "backward")
            if not torn:
                self._ranks.any_oom(True)
        self._recover(kind, message, phase, torn, at_start)
        return None

    def _accumulate_and_step(self, batch: Any) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        sizes, start = split_sizes(self.per_process, self.micro_batch), 0
        for index, size in enumerate(sizes):
            part = slice_batch(batch, start, start + size)
            start += size
            last = index == len(sizes) - 1
            total += self._micro_step(part, size / self.per_process, last)
            self.channel.heartbeat(self.step_count)
        if self._ranks is not None:
            self._phase = "agree"
            self._ranks.settle()
        self._optimizer_step()
        return float(total)

    def _micro_step(self, part: Any, weight: float, last: bool) -> torch.Tensor:
        # DDP: all-reduce only on the last micro-batch (its no_sync() skips the others); with several
        # ranks never inside backward: settle() averages after every rank said it had no OOM.
        no_sync = getattr(self.model, "no_sync", None)
        sync = last and self._ranks is None
        with no_sync() if (no_sync is not None and not sync) else contextlib.nullcontext():
            self._phase = "forward"
            weighted = self.loss_fn(self.model, part) * weight
            self._phase = "backward"
            (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
        return weighted.detach().to("cpu", torch.float64)

    def _optimizer_step(self) -> None:
        self._phase = "optimizer"
        if self.config.recover_in_process:
            self._versions = self._tensor_versions()
        if self.scaler is not None:
            if self.config.max_grad_norm is not None:
                self.scaler.unscale_(self.optimizer)
                self._clip()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self._clip()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self._phase = "idle"

    def _clip(self) -> None:
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)

    def _tensor_versions(self) -> list[int]:
        # In-place updates bump a tensor's version counter: comparing the counters after an OOM
        # in optimizer.step() tells a clean failure (state allocation) from a half-applied update.
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors += [
            t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ]
        return [t._version for t in tensors]

    def _optimizer_touched(self) -> bool:
        current = self._tensor_versions()
        return current[: len(self._versions)] != self._versions

    # ----- recovery

    def _recover(self, kind: str, message: str, phase: str, torn: bool, at_start: dict[str, Any]) -> None:
        self._phase = "idle"
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            # unscale_() marks the optimizer UNSCALED until update(); a retry must start clean.
            self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        oom.release_memory()
        checkpoint.restore(at_start)
        failed = self.micro_batch
        decision = None if (torn or not self.config.recover_in_process) else self.tuner.on_oom()
        if kind != oom.PEER_OOM:  # the rank that failed reports it; its peers only follow
            self.channel.failure(
                kind, message, failed, phase=phase, step=self.step_count, recovered=decision is not None
            )
        if decision is None:
            raise OutOfMemoryAbort(self._abort_reason(message, failed, torn))
        self._announce(decision)

    def _abort_reason(self, message: str, failed: int, torn: bool) -> str:
        if torn:
            why = "the OOM struck inside optimizer.step() after it had changed weights or state"
        elif not self.config.recover_in_process:
            why = "in-process recovery is off"
        else:
            why = f"no divisor of {self.per_process} below {failed} is at least {self.config.min_micro_batch}"
        return (
            f"giving up on this process at micro_batch={failed} ({why}); restart from a checkpoint. {message}"
        )

    def _announce(self, decision: BatchDecision) -> None:
        self.channel.batch(decision.micro_batch, self.grad_accum, decision.reason, step=self.step_count)

    def _die(self, kind: str, exc: BaseException) -> NoReturn:
        # The CUDA context is unusable: any cleanup may hang or fail again, so report and leave.
        traceback.print_exception(exc, file=sys.stderr)
        self.channel.failure(
            kind, oom.summarize(exc), self.micro_batch, phase=self._phase, step=self.step_count
        )
        sys.stderr.flush()
        os._exit(1)

    # ----- after the step

    def _after_step(self, result: StepResult) -> None:
        above = self.probe.bytes_above_start()
        per_sample = above / result.micro_batch if above > 0 else None
        decision = self.tuner.on_success(per_sample, self.probe.headroom())
        if self._ranks is not None and self.tuner.grow_after is not None:
            decision = self._agree_on_growth(decision)
        self.channel.progress(
            result.step,
            force=result.ooms > 0 or result.step == 1,
            samples=self.samples,
            loss=result.loss,
            micro_batch=result.micro_batch,
            grad_accum=result.grad_accum,
            samples_per_s=self.global_batch / max(result.seconds, 1e-9),
            total_steps=self.config.total_steps,
            **self._memory_fields(),
        )
        if decision is not None:
            self._announce(decision)
        self._at_boundary()

    def _agree_on_growth(self, decision: BatchDecision | None) -> BatchDecision | None:
        """Each rank measures its own memory; the ranks grow only when every one of them can."""
        assert self._ranks is not None
        agreed = self._ranks.smallest(self.tuner.current)
        if agreed < self.tuner.current:
            self.tuner.current, self.tuner.trial = agreed, False
            return None
        return decision

    def _memory_fields(self) -> dict[str, int]:
        fields = {"rss_bytes": self.probe.rss()}
        if self.probe.cuda:
            fields["peak_gpu_bytes"] = self.probe.step_peak()
        return fields

    def _at_boundary(self) -> None:
        self._report_async_writes()
        stop = self.requests.stop_signal
        requested = self.requests.checkpoint_wanted()
        every = self.config.checkpoint_every
        scheduled = every is not None and self.step_count % every == 0
        if self.store is not None and (stop is not None or requested or scheduled):
            # A request or a stop is only answered once the checkpoint is on disk.
            self.save(sync=stop is not None or requested)
        if requested:
            self.requests.checkpoint_done()
        if stop is not None:
            self.close(final_checkpoint=False)
            raise SystemExit(128 + stop)

    # ----- saving

    def save(self, sync: bool = False) -> Path | None:
        """Checkpoint the current step (asynchronously when configured and ``sync`` is False)."""
        if self.store is None or self.writer is None:
            raise RuntimeError("Session.save() needs SessionConfig.checkpoint_dir")
        self._saved_step = self.step_count
        if self.config.async_save and not sync:
            self.writer.submit(self.step_count, checkpoint.to_cpu_copy(self.state_dict()), self.fingerprint)
            return None
        self._flush_writes()
        path = self.store.save(self.step_count, self.state_dict(), self.fingerprint)
        self.channel.checkpoint(str(path), self.step_count)
        return path

    def _flush_writes(self) -> None:
        if self.writer is not None:
            self.writer.wait()
        self._report_async_writes()

    def _report_async_writes(self) -> None:
        if self.writer is not None:
            for path, step in self.writer.finished():
                self.channel.checkpoint(str(path), step)


# ----- configuration from the environment


def _resolve_global(config: SessionConfig) -> tuple[int, int]:
    world = protocol.env_int(protocol.ENV_WORLD_SIZE) or config.world_size
    env_global = protocol.env_int(protocol.ENV_GLOBAL_BATCH)
    if env_global is not None and config.global_batch is not None and env_global != config.global_batch:
        raise ValueError(
            f"{protocol.ENV_GLOBAL_BATCH}={env_global} but SessionConfig.global_batch={config.global_batch}; "
            "pass the supervisor's {global_batch} to the script or leave global_batch unset"
        )
    global_batch = env_global or config.global_batch
    if global_batch is None:
        raise ValueError("set SessionConfig.global_batch (or run under `oomguard run --global-batch N`)")
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} is not divisible by world size {world}")
    return global_batch, world


def _resolve_micro(config: SessionConfig, per_process: int) -> int:
    micro = protocol.env_int(protocol.ENV_MICRO_BATCH)
    accum = protocol.env_int(protocol.ENV_GRAD_ACCUM)
    if micro is None and accum is not None:
        micro = per_process // accum
    micro = micro or config.micro_batch or per_process
    if not 1 <= micro <= per_process:
        raise ValueError(
            f"micro-batch {micro} is above the per-process batch {per_process}; "
            f"divisors that split it evenly: {divisors(per_process)}"
        )
    return micro


def _device_of(model: torch.nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def _fingerprint(session: Session) -> str:
    """What a checkpoint must match to be resumed: batch arithmetic, shapes, optimizer, data order.
    The micro-batch is deliberately left out: changing it is the whole point."""
    config = session.config
    facts = {
        "global_batch": session.global_batch,
        "world_size": session.world_size,
        "model": [(n, list(p.shape), str(p.dtype)) for n, p in session.model.state_dict().items()],
        "optimizer": [type(session.optimizer).__name__, session.optimizer.defaults],
        "data": [config.seed, config.shuffle],
        "extra": config.fingerprint_extra,
    }
    text = json.dumps(facts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()
