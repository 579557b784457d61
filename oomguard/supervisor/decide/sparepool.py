"""How many spare interpreters to keep (run/spare.py): the next attempt's, and a reserve for the one after.

One spare, started when an attempt starts, is ready for the next attempt only if that attempt lives
longer than the spare's imports. An attempt that itself started from a spare reaches its OOM within
seconds (its imports are done), so after back-to-back OOMs the next worker waited for a spare still
importing (docs/restart.md: the second restart at 0.66-0.88 of cold against 0.34-0.48 for the first).
The reserve is a second spare, started with the first (below it in priority): by the time an
attempt from a spare ends, the reserve has had the whole of the attempt before to import in.

- At most ``POOL`` spares. The reserve starts as soon as it is allowed; while the spare before it
  is still importing it runs at nice 19 (``run/spare.RESERVE_NICE``) behind that one's 10, so on a
  machine with cores to spare both import at once, and on a busy one the reserve takes only the CPU
  time nobody else wants until the first has imported, then goes up to nice 10: the next attempt's
  spare is not slowed by it, nor is the running attempt. Where a spare's priority could not be
  raised back (not root, RLIMIT_NICE) spares start at the worker's priority, and then one imports
  at a time.
- The reserve holds host memory (an idle interpreter with torch: hundreds of MB) that the worker
  might need. It is started only while the host keeps ``FREE_SHARE`` of its memory, and at least
  ``FREE_SPARES`` times a spare's size, available after it; held while that stays true. Below it, the
  reserve is dropped and not started again in that run: a run that came that close to its host's
  memory once will again, and a spare started and killed in turn would only take CPU.
- Every spare, the next attempt's and the reserve, fits under the tightest limit that holds the
  worker and the spares (``spare_room``): a cgroup limit above both, or the host, less the
  worker's measured peak and a margin (docs/restart.md, "Spares and memory limits").

Pure: the loop's spare keeper (``run/spare.Spares``) brings the counts and the host's figures.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    ``running``: the spare is one of those held (is there still room for it?).

    - The worker's need known (its peak plus the margin, or ``--memory-limit``): the limit, less
      that, less the spares held and whatever else is in it, must leave the spare's size.
    - Not known yet, under a cgroup limit: a job's limit is sized to the job, so a spare starts
      only where a quarter of the limit and four spares' worth stay free after it (the reserve's
      rule on a host); before the worker has trained, that is rarely so, and the first attempt's
      spare waits for the worker's peak.
    - Not known yet, on the host alone: the host's rules (``reserve_fits`` for the reserve).
    """
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
    if free - spare >= max(FREE_SHARE * limit.limit, FREE_SPARES * spare):
        return ""
    return (f"the worker's peak is not known yet and {limit.name} {gib(limit.limit)} has {gib(max(0, free))} free; "
            f"a spare ({gib(spare)}) starts before then only where a quarter of the limit and four spares' worth "
            "stay free after it")


# ----- the worker's OOM score beside spares

SPARE_SCORE = 1000  # a spare's oom_score_adj: the kernel's first choice, as far as a score can make it
WORKER_ABOVE = 500  # a worker's usual oom_score_adj above oomguard's own (run/process.py)


def worker_score(own: int, spares: list[int], limit: int) -> int:
    """The worker's oom_score_adj beside spares of ``spares`` bytes each (resident), at SPARE_SCORE,
    under ``limit`` (the limit that holds them; the kernel's unit for a score is a thousandth of it).

    The OOM killer takes the highest RSS + adj * limit / 1000. A spare at 1000 is only
    (1000 - adj) thousandths of the limit ahead of a worker at adj, and at the limit the worker's
    charged memory is at most limit - spares: the largest spare scores above it while adj is below
    1000 * (largest + all spares) / limit. Half that is used: the other half is slack for pages in
    the worker's RSS charged elsewhere (a shared library another process loaded first) and the
    kernel's rounding (at the full bound a worker beside a 60 MiB spare in 600 MiB was still taken:
    tests/e2e/test_spare_budget.py). Never more than the usual WORKER_ABOVE above ours, never less than
    one above ours (the kernel still prefers the worker to oomguard)."""
    if not spares or limit <= 0:
        return min(1000, own + WORKER_ABOVE)
    bound = 500 * (max(spares) + sum(spares)) // limit
    return min(1000, max(own + 1, min(own + WORKER_ABOVE, bound)))
