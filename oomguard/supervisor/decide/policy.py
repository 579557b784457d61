"""The recovery policy: one pure function from what happened to what to do next.

``decide`` does no I/O and reads no clock; the event loop carries out its ``Decision``. Also here:
every change of the run's plan other than a failure's (``PlanChange``), and how many spare
interpreters to keep (run/spare.py): a reserve, so that back-to-back OOMs do not outrun them, that
never stands between the worker and the memory it needs (docs/restart.md).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.attribution import Attribution, Cause
from oomguard.supervisor.decide.classify import Addition, FailureKind, Fatal, OwnFault, give_up

CRASH_LOOP_REPEATS = 3  # the same failure this many times in a row, with no new checkpoint: give up


@dataclass(frozen=True)
class Plan:
    """How the next attempt runs: its batch shape and the remedies applied so far."""

    batch: BatchPlan
    expandable_segments: bool = False  # merge expandable_segments:True into the allocator settings
    fallbacks_applied: int = 0  # how many of --fallback-args are in use
    eval_micro_batch: int | None = None  # {eval_micro_batch}: the script's own evaluation batch
    num_workers: int | None = None  # {num_workers}: the script's DataLoader workers

    def as_dict(self) -> dict[str, Any]:
        """The plan as the journal keeps it (and a restarted supervisor reads it back)."""
        remedies = asdict(self)
        del remedies["batch"]
        return {**asdict(self.batch), "grad_accum": self.batch.grad_accum, **remedies}

    def resumed(self, saved: Mapping[str, Any] | None) -> Plan | None:
        """The plan an earlier supervisor saved for this run, when it is for the same job; else None."""
        b = self.batch
        if not saved or saved["world_size"] != b.world_size:
            return None
        if (saved.get("asked_global") or saved["global_batch"]) != b.asked or not b.fits(saved["micro_batch"]):
            return None
        return Plan(b.with_micro_batch(saved["micro_batch"]), saved["expandable_segments"],
                    saved["fallbacks_applied"], saved.get("eval_micro_batch", self.eval_micro_batch),
                    saved.get("num_workers", self.num_workers))


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as the policy sees it."""

    attempt: int
    kind: FailureKind
    micro_batch: int
    evidence: str = ""
    fragmented: bool = False  # decide.fragmentation judged the OOM's allocator figures fragmentation
    new_checkpoint: bool = False  # a newer checkpoint appeared during the attempt
    checkpoint: str | None = None  # the checkpoint it was started from
    load_error: bool = False  # it died before progress with an error reading that checkpoint
    attribution: Attribution | None = None  # the cause of a memory failure (attribution.py)
    fatal: Fatal | None = None  # an error before the first step that a restart meets again (unfixable.py)
    own: OwnFault | None = None  # it died in oomguard's own code (ownfault.py): never the script's


@dataclass(frozen=True)
class PolicyConfig:
    min_micro_batch: int = 1
    max_restarts: int = 10
    backoff: float = 1.0
    max_backoff: float = 60.0
    fallback_count: int = 0
    smaller_global_batch: bool = False  # --allow-smaller-global-batch: a script without accumulation may shrink


class Action(enum.Enum):
    RESTART = "restart"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class Decision:
    action: Action
    plan: Plan
    reason: str
    delay: float = 0.0
    bad_checkpoint: str | None = None  # mark this checkpoint bad and resume from the one before
    unfixable: bool = False  # given up on an error no restart can fix: the run ends with EXIT_UNFIXABLE
    turn_off: Addition | None = None  # oomguard's own addition that failed: the attempts after run without it

    @property
    def restart(self) -> bool:
        return self.action is Action.RESTART


def decide(failure: Failure, history: Sequence[Failure], plan: Plan, config: PolicyConfig,
           fit_hint: int | None = None) -> Decision:
    """What to do after ``failure``, given the run's earlier failures (oldest first) and the memory
    model's largest micro-batch predicted to fit. A failure of oomguard's own code restarts without
    the addition that failed, and no failure of ours is counted against the script."""
    own = failure.own
    # Once per addition: it is off after its failure, so a second one would mean it was not (a bug of
    # ours), and the run must not restart for ever uncounted: that one counts as the script's would.
    if own is not None and not any(e.own is not None and e.own.addition is own.addition for e in history):
        return Decision(Action.RESTART, plan, own.reason, turn_off=own.addition)
    history = [earlier for earlier in history if earlier.own is None]
    if failure.load_error and failure.checkpoint and _within_budget(failure, history, config):
        return Decision(Action.RESTART, plan, f"checkpoint {failure.checkpoint} could not be loaded; "
                        "resuming from the previous one", bad_checkpoint=failure.checkpoint)
    if failure.kind.is_memory:
        return _after_attributed(failure, history, plan, config, fit_hint)
    previous = history[-1] if history and history[-1].attempt == failure.attempt - 1 else None
    fatal = failure.fatal if failure.kind is FailureKind.CRASH else None
    if (why := give_up(fatal, previous.fatal if previous else None, failure.attempt)) is not None:
        return Decision(Action.GIVE_UP, plan, why, unfixable=True)
    return _after_other_failure(failure, history, plan, config)


def _after_memory_failure(failure: Failure, plan: Plan, config: PolicyConfig,
                          fit_hint: int | None) -> Decision:
    # Fragmentation first: the memory exists but is cut into pieces; the expandable-segments
    # allocator fixes that without giving up batch size. ``fragmented`` is decide.fragmentation's
    # judgement of the allocator's figures: a large share of the memory unusable, not a few GiB.
    also = ""
    if failure.kind is FailureKind.CUDA_OOM and not plan.expandable_segments:
        if failure.fragmented:
            return Decision(Action.RESTART, replace(plan, expandable_segments=True),
                            "fragmentation: a large share of the memory reserved-but-unallocated; retrying "
                            f"micro-batch {plan.batch.micro_batch} with expandable_segments:True")
        # Not fragmentation: shrink now, and set the allocator option in the same restart (it
        # costs nothing and saves an attempt should the smaller size fragment later).
        plan, also = replace(plan, expandable_segments=True), " (and expandable_segments:True)"
    batch = plan.batch
    smaller = batch.largest_at_most(failure.micro_batch // 2, config.min_micro_batch)
    # The memory model's choice wins when it is a valid smaller size: it only goes above half the
    # failed size once two successful attempts back the prediction (memmodel.shrink_after_oom).
    if fit_hint is not None and config.min_micro_batch <= fit_hint < failure.micro_batch and batch.fits(fit_hint):
        smaller = fit_hint
    refused = smaller is not None and not batch.accumulates and not config.smaller_global_batch
    if smaller is not None and not refused:
        new = replace(plan, batch=batch.with_micro_batch(smaller))
        return Decision(Action.RESTART, new, f"{failure.kind.value} at micro-batch {failure.micro_batch}: "
                        f"{new.batch.describe()}{also}")
    return _at_the_floor(failure, plan, config, also, smaller if refused else None)


def _at_the_floor(failure: Failure, plan: Plan, config: PolicyConfig, also: str, refused: int | None) -> Decision:
    """No smaller micro-batch (or, ``refused``, one that would shrink the global batch): the fallbacks,
    then the allocator option, then give up."""
    batch = plan.batch
    floor = (f"micro-batch {failure.micro_batch}, which may not shrink (the global batch with it)"
             if refused is not None else f"the smallest micro-batch {failure.micro_batch}")
    if plan.fallbacks_applied < config.fallback_count:
        n = plan.fallbacks_applied + 1
        return Decision(Action.RESTART, replace(plan, fallbacks_applied=n),
                        f"{failure.kind.value} at {floor}; adding fallback {n} of {config.fallback_count}")
    if also:  # at the floor with nothing else left: the allocator option is the last thing to try
        return Decision(Action.RESTART, plan, f"{failure.kind.value} at {floor}; retrying with "
                        "expandable_segments:True")
    if refused is not None:  # it would train at a smaller global batch while the run claims the one asked for
        return Decision(Action.GIVE_UP, plan, f"{failure.kind.value} at micro-batch {failure.micro_batch}: the command "
                        f"passes no {{grad_accum}}, so micro-batch {refused} would shrink the global batch from "
                        f"{batch.global_batch} to {refused * batch.world_size}; pass --allow-smaller-global-batch to "
                        "train at that, or put {grad_accum} where the script takes its accumulation")
    return Decision(Action.GIVE_UP, plan,
                    f"out of memory even at the smallest micro-batch ({failure.micro_batch}, "
                    f"--min-micro-batch {config.min_micro_batch}) with every fallback applied: "
                    "the model does not fit; use a larger GPU, fewer parameters or more --fallback-args")


def _after_other_failure(failure: Failure, history: Sequence[Failure], plan: Plan,
                         config: PolicyConfig) -> Decision:
    if not _within_budget(failure, history, config):
        return Decision(Action.GIVE_UP, plan, f"{failure.kind.value} again and --max-restarts "
                        f"{config.max_restarts} is used up; last: {failure.evidence}")
    recent = [*history[-(CRASH_LOOP_REPEATS - 1):], failure]  # a crash loop: the same failure, no checkpoint
    if len(recent) == CRASH_LOOP_REPEATS and all(
            f.kind is failure.kind and f.evidence == failure.evidence and not f.new_checkpoint for f in recent):
        return Decision(Action.GIVE_UP, plan, f"crash loop: {failure.kind.value} {CRASH_LOOP_REPEATS} "
                        f"times in a row with no new checkpoint; last: {failure.evidence}")
    streak = _streak(history, failure)
    delay = min(config.max_backoff, config.backoff * 2 ** (streak - 1))
    return Decision(Action.RESTART, plan, f"{failure.kind.value}: restarting at the same batch "
                    f"after {delay:g} s", delay=delay)


def _within_budget(failure: Failure, history: Sequence[Failure], config: PolicyConfig) -> bool:
    """Crashes, kills and hangs share --max-restarts; memory failures do not use it up."""
    return len([f for f in (*history, failure) if not f.kind.is_memory]) <= config.max_restarts


def _streak(history: Sequence[Failure], failure: Failure) -> int:
    """How many non-memory failures in a row end the history, counting back to the last attempt
    that made progress (wrote a checkpoint): the backoff starts over after progress."""
    n = 1
    if failure.new_checkpoint:
        return n
    for earlier in reversed(history):
        if earlier.kind.is_memory:
            break
        n += 1
        if earlier.new_checkpoint:
            break
    return n


# --- the remedy for each cause of a memory failure (attribution.py) ------------------------------


def _after_attributed(failure: Failure, history: Sequence[Failure], plan: Plan, config: PolicyConfig,
                      fit_hint: int | None) -> Decision:
    """Blame the batch only for what the batch did. Fragmentation's remedy wins whatever the
    cause; per-sample failures, and causes whose own remedy is used up, take the batch path."""
    batch_path = _after_memory_failure(failure, plan, config, fit_hint)
    attribution = failure.attribution
    if failure.fragmented or attribution is None or attribution.cause is Cause.PER_SAMPLE:
        return batch_path
    cause, summary = attribution.cause, attribution.summary
    if cause is Cause.LEAK:
        return _after_leak(failure, history, plan, summary, attribution.also is not None)
    if cause in (Cause.SAVING, Cause.LOADING):
        return _after_fixed_phase(failure, history, plan, cause, summary)
    if cause is Cause.EVALUATION and plan.eval_micro_batch is not None and plan.eval_micro_batch > 1:
        smaller = plan.eval_micro_batch // 2
        return Decision(Action.RESTART, replace(plan, eval_micro_batch=smaller),
                        f"{summary}: eval micro-batch {plan.eval_micro_batch} -> {smaller}; "
                        f"training micro-batch stays {plan.batch.micro_batch}")
    if cause is Cause.DATA_LOADER and plan.num_workers:
        fewer = plan.num_workers // 2
        return Decision(Action.RESTART, replace(plan, num_workers=fewer),
                        f"{summary}: DataLoader workers {plan.num_workers} -> {fewer} before the batch; "
                        f"micro-batch stays {plan.batch.micro_batch}")
    # Evaluation at the training batch follows the micro-batch; a data loader with no workers left
    # to cut (or no {num_workers}) loads less with a smaller batch.
    return replace(batch_path, reason=f"{summary}; {batch_path.reason}")


def _repeated_without_progress(failure: Failure, history: Sequence[Failure], cause: Cause) -> bool:
    previous = history[-1] if history else None
    return (previous is not None and previous.attribution is not None and previous.attribution.cause is cause
            and not failure.new_checkpoint)


def _after_leak(failure: Failure, history: Sequence[Failure], plan: Plan, summary: str, spiked: bool) -> Decision:
    """A leak grows with time, not with the batch: restart at the same size from the newest checkpoint
    (a leak that also ``spiked`` too: the leak's growth gives the spike its room back), unless it
    brings the worker down before it writes one."""
    if _repeated_without_progress(failure, history, Cause.LEAK):
        return Decision(Action.GIVE_UP, plan, f"{summary}: it brings the worker down before it writes a "
                        "checkpoint (no progress between restarts), so restarting cannot finish the run; "
                        "fix the leak or checkpoint more often")
    why = "the leak's growth, not the batch, used the room" if spiked else "the batch is not to blame"
    return Decision(Action.RESTART, plan, f"{summary}: restarting at the same micro-batch "
                    f"{plan.batch.micro_batch} from the newest checkpoint ({why})")


_PHASE_HINT = {
    Cause.SAVING: "save from the model's state without extra copies (or offload it to CPU first)",
    Cause.LOADING: "load the checkpoint with map_location='cpu' and free it once the state is copied",
}


def _after_fixed_phase(failure: Failure, history: Sequence[Failure], plan: Plan, cause: Cause,
                       summary: str) -> Decision:
    """Saving and loading a checkpoint take the same memory at any micro-batch: halving would cost
    throughput for the rest of the run and fix nothing. Retry once; again with no progress: give up."""
    if _repeated_without_progress(failure, history, cause):
        return Decision(Action.GIVE_UP, plan, f"{summary} again with no progress since, at micro-batch "
                        f"{plan.batch.micro_batch}; its memory does not follow the micro-batch: {_PHASE_HINT[cause]}")
    return Decision(Action.RESTART, plan, f"{summary}: its memory does not follow the micro-batch; restarting "
                    f"at micro-batch {plan.batch.micro_batch} from the newest good checkpoint")


# Every change of the run's plan, as a pure function that returns the new plan with its reason.
#
# A failure's change comes from ``decide`` above; the others come from here: continuing a run an
# earlier supervisor left, the fit store's starting size, ``--grow``, a planned restart, allocator
# settings the user already gave, and node 0's plan on the other nodes. The loop applies a
# ``PlanChange`` in one place, which journals it (``plan_change`` events), so every plan an attempt
# ran with can be traced to one of these and its reason.


class Source(enum.Enum):
    SAVED = "saved"  # the plan an earlier supervisor of this run directory saved
    FIT_STORE = "fit_store"  # an earlier run of the same job fitted a size
    DECISION = "decision"  # the policy, after a failure
    GROW = "grow"  # --grow, after a stable stretch and a checkpoint
    PLANNED_RESTART = "planned_restart"  # the memory forecast: same plan, fresh process
    ALLOCATOR = "allocator"  # expandable_segments was already in the user's environment
    AGREED = "agreed"  # several nodes: node 0's plan for this round


@dataclass(frozen=True)
class PlanChange:
    plan: Plan
    source: Source
    reason: str


def continue_saved(plan: Plan, saved: Mapping[str, Any] | None) -> PlanChange | None:
    """The plan an earlier supervisor saved for this run directory, when it is the same job."""
    resumed = plan.resumed(saved)
    if resumed is None:
        return None
    return PlanChange(resumed, Source.SAVED, f"continuing the saved plan at micro-batch {resumed.batch.micro_batch}")


def start_at_fitted(plan: Plan, micro_batch: int | None, job: str, gpu: bool = False) -> PlanChange | None:
    """A fresh run starts where an earlier run of the same job settled (the fit store); on a GPU with
    ``expandable_segments:True``, which the size was measured with (the policy sets it at a CUDA OOM)."""
    if micro_batch is None or micro_batch == plan.batch.micro_batch:
        return None
    new = replace(plan, batch=plan.batch.with_micro_batch(micro_batch),
                  expandable_segments=plan.expandable_segments or gpu)
    also = " with expandable_segments:True" if new.expandable_segments and not plan.expandable_segments else ""
    return PlanChange(new, Source.FIT_STORE,
                      f"an earlier run of this job fitted micro-batch {micro_batch}{also} ({job})")


def after_failure(decision: Decision) -> PlanChange:
    return PlanChange(decision.plan, Source.DECISION, decision.reason)


def grow(plan: Plan, micro_batch: int, why: str = "grow") -> PlanChange:
    """--grow (or a fit measured for another model): a larger micro-batch, the global batch kept."""
    bigger = replace(plan, batch=plan.batch.with_micro_batch(micro_batch))
    return PlanChange(bigger, Source.GROW, f"{why}: micro-batch {plan.batch.micro_batch} -> {micro_batch} × "
                      f"accumulation {bigger.batch.grad_accum}")


def planned_restart(plan: Plan, reason: str) -> PlanChange:
    """The forecast's restart right after a checkpoint: the batch is not to blame, the plan stays."""
    return PlanChange(plan, Source.PLANNED_RESTART, f"{reason}; restarting at micro-batch {plan.batch.micro_batch}")


def allocator_from_environment(plan: Plan, expandable_in_env: bool) -> PlanChange | None:
    """The user's own PYTORCH_CUDA_ALLOC_CONF already has expandable_segments:True: the policy must
    not spend a restart "trying" it after an OOM."""
    if plan.expandable_segments or not expandable_in_env:
        return None
    return PlanChange(replace(plan, expandable_segments=True), Source.ALLOCATOR,
                      "expandable_segments:True is already in the environment")


def agreed(plan: Plan, node0: Plan) -> PlanChange | None:
    """Several nodes: every node runs node 0's plan for the round."""
    if node0 == plan:
        return None
    return PlanChange(node0, Source.AGREED, f"the nodes' shared plan for this round: {node0.batch.describe()}")


# --- how many spare interpreters to keep (run/spare.py): the next attempt's, and a reserve for the one
# after, each within the limit that holds the worker (the rules and the measurements: docs/restart.md).

POOL = 2  # the next attempt's spare and a reserve for the attempt after it
FREE_SHARE = 0.25  # of the host's memory, available after the reserve
FREE_SPARES = 4  # and at least this many spares' worth


def reserve_fits(available: int, total: int, spare_bytes: int) -> bool:
    """Does the host keep enough memory available beside one more idle interpreter of ``spare_bytes``?
    To ask whether to keep a reserve that already holds its memory, add its bytes to ``available``."""
    return available - spare_bytes >= max(FREE_SHARE * total, FREE_SPARES * spare_bytes)


def spares_to_start(waiting: int, importing: int, reserve: bool, behind: bool) -> int:
    """How many spares to start now: ``waiting`` have imported, ``importing`` have not yet; a
    ``reserve`` is allowed (the host has room, the run has not dropped it); ``behind``: a spare
    can import behind another at a lower priority (its priority can be raised later); if not,
    one imports at a time."""
    room = (POOL if reserve else 1) - waiting - importing
    if room <= 0:
        return 0
    return room if behind else (1 if importing == 0 else 0)


# ----- the limit that holds the worker and its spares (docs/restart.md, "Spares and memory limits")

MARGIN_SHARE = 0.10  # above the worker's measured peak: a later step (validation, a save) may reach higher
MARGIN_MIN = 64 << 20  # and never less than this
SPARE_GUESS = 512 << 20  # a spare's size before one has imported (torch and Lightning: 376 MB measured)
GIB = float(1 << 30)


@dataclass(frozen=True)
class Limit:
    """The tightest memory limit that holds the worker and its spares (a cgroup above both, or the
    host), and what is counted against it now: the worker, the spares, oomguard, anything else in it."""

    limit: int
    used: int
    name: str  # "the cgroup limit" or "the host's memory", as status says it
    cgroup: bool  # a job's limit (Slurm --mem, a pod's, docker --memory, MemoryMax), not the whole host


@dataclass(frozen=True)
class WorkerMemory:
    """The worker's memory now, its peak once it has trained (None before: the first attempt's
    first steps), and ``--memory-limit``, past which it cannot grow."""

    now: int
    peak: int | None = None
    bound: int | None = None

    def need(self) -> int | None:
        """What to keep free for the worker: its peak plus the margin, else its own limit, else unknown."""
        if self.peak is not None:
            peak = max(self.peak, self.now)
            return peak + max(int(peak * MARGIN_SHARE), MARGIN_MIN)
        return self.bound


def gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def spare_room(limit: Limit, worker: WorkerMemory, held: int, spare: int, running: bool = False) -> str:
    """"" when one more spare of ``spare`` bytes fits beside the worker and the ``held`` bytes of
    the spares already running, under the limit that holds them all; else why not, in words.
    ``running``: the spare is one of those held (is there still room for it?). Before the worker's
    need is known, a cgroup limit keeps the reserve's rule (docs/restart.md, "Spares and memory limits")."""
    others = max(0, limit.used - worker.now - held)  # oomguard itself, and anything else in the limit
    beside = held - spare if running else held
    need = worker.need()
    if need is not None:
        room = limit.limit - others - beside - need
        if room >= spare:
            return ""
        what = f"its peak {gib(worker.peak)} and a margin" if worker.peak is not None else f"--memory-limit {gib(need)}"
        return (f"{limit.name} {gib(limit.limit)} leaves {gib(max(0, room))} above {what}"
                + (f" and the spares held ({gib(beside)})" if beside else "") + f"; a spare needs {gib(spare)}")
    if not limit.cgroup:
        return ""
    free = limit.limit - limit.used + (spare if running else 0)
    if reserve_fits(free, limit.limit, spare):
        return ""
    return (f"the worker's peak is not known yet and {limit.name} {gib(limit.limit)} has {gib(max(0, free))} free; "
            f"a spare ({gib(spare)}) starts before then only where a quarter of the limit and four spares' worth "
            "stay free after it")


# ----- the worker's OOM score beside spares

SPARE_SCORE = 1000  # a spare's oom_score_adj: the kernel's first choice, as far as a score can make it
WORKER_ABOVE = 500  # a worker's usual oom_score_adj above oomguard's own (run/process.py)


def worker_score(own: int, spares: list[int], limit: int) -> int:
    """The worker's oom_score_adj beside spares of ``spares`` bytes each (resident), at SPARE_SCORE,
    under ``limit``: half the bound under which the largest spare outscores the worker at the limit
    (the other half is slack; docs/restart.md, "What the kernel does at the limit"), within
    (own + 1, own + WORKER_ABOVE)."""
    if not spares or limit <= 0:
        return min(1000, own + WORKER_ABOVE)
    bound = 500 * (max(spares) + sum(spares)) // limit
    return min(1000, max(own + 1, min(own + WORKER_ABOVE, bound)))
