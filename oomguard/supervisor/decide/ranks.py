"""Classification across ranks: an attempt of several ranks ends the way its root-cause rank ended.

Under torchrun the supervised process is the agent, which exits 1 whatever killed a rank; the
single-process rules in ``classify`` would call a rank's kernel OOM kill a crash. Here the rank
that failed first (``dist.errorfiles.root_cause``) decides: an allocator OOM on any rank is that OOM;
a rank that died of SIGKILL while the worker cgroup's ``oom_kill`` counter rose is ``host_oom``
(or ``memory_limit`` at oomguard's own limit); collective timeouts on the surviving ranks are
consequences, so they never decide. Pure: the tests feed it facts.
"""

from __future__ import annotations

import signal

from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, Verdict, classify
from oomguard.supervisor.dist.errorfiles import RootCause
from oomguard.supervisor.observe.output import OutputScanner

_KINDS = {"cuda_oom": FailureKind.CUDA_OOM, "host_oom": FailureKind.HOST_OOM}


def classify_attempt(facts: ExitFacts, scan: OutputScanner, cause: RootCause | None, gpus: bool = False) -> Verdict:
    """``classify`` for one process; with a root-cause rank, the verdict of that rank."""
    if cause is None or facts.returncode == 0 or facts.hung or facts.stopped_for_memory:
        return classify(facts, scan)
    where = cause.where(gpus)

    def verdict(kind: FailureKind, evidence: str) -> Verdict:
        code = cause.exitcode if cause.exitcode is not None and cause.exitcode >= 0 else None
        return Verdict(kind, f"{where}: {evidence}", cause.signal, code)

    before, after = facts.oom_kills_before, facts.oom_kills_after
    if cause.signal == signal.SIGKILL and before is not None and after is not None and after > before:
        counter = f"{facts.oom_counter} oom_kill {before}->{after}"
        if facts.limit_hit:
            return verdict(FailureKind.MEMORY_LIMIT, f"{counter} at oomguard's --memory-limit")
        return verdict(FailureKind.HOST_OOM, f"killed by the kernel OOM killer ({counter})")
    if cause.oom_kind in _KINDS:
        return verdict(_KINDS[cause.oom_kind], cause.message)
    # OOM text no rank prefix claims (printed before the process group was up): the blamed rank's
    if scan.device_oom:
        return verdict(FailureKind.CUDA_OOM, scan.device_oom.strip())
    if scan.host_oom:
        return verdict(FailureKind.HOST_OOM, scan.host_oom.strip())
    if facts.worker_failure and str(facts.worker_failure.get("kind", "")) in _KINDS:
        return verdict(_KINDS[str(facts.worker_failure["kind"])], str(facts.worker_failure.get("message", "")))
    if cause.signal is not None:
        name = signal.Signals(cause.signal).name if cause.signal in signal.Signals._value2member_map_ \
            else f"signal {cause.signal}"
        return verdict(FailureKind.KILLED, f"terminated by {name}; no OOM-kill counter moved")
    return verdict(FailureKind.CRASH, f"exit code {cause.exitcode}: {cause.message}" if cause.exitcode is not None
                   else cause.message)
