"""Every sentence is true (issue 35, part 5), over scripted figures and real tracebacks: a trend line
is never negative memory nor memory "below its" limit at a failure; a host OOM under RLIMIT_AS is
told against the address-space limit the probe saw, not the host's; a crash's evidence is its
exception line; the program behind wrappers is the one judged Python or not; the status picture
shows the step a new attempt resumed from."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oomguard.supervisor.command import not_python, unwrap
from oomguard.supervisor.decide.attribution import Evidence, Limit, attribute
from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, classify
from oomguard.supervisor.observe.allocator import OomProgress
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.record.status import current_progress
from oomguard.supervisor.run.attempt import HOST, MACHINE, TrendWatch
from oomguard.supervisor.sizing.trend import Headroom, Reading, steady_rise

MIB = 2**20
HOST_TOTAL = 24106 * MIB
NEGATIVE_MIB = re.compile(r"-\d+(?:\.\d+)? MiB")


def falling(n: int = 40, start: int = 3000 * MIB, per_s: int = -200 * MIB) -> list[Reading]:
    """The host's memory in use falling fast and steadily (another job freeing its memory), one
    reading a second: carried to a failure 30 s after the last reading, the line is below 0."""
    return [Reading(100.0 + i, start + per_s * i // 4, None) for i in range(n)]


def test_a_trend_line_carried_below_zero_is_no_memory_and_no_figure() -> None:
    readings = falling()
    room = Limit("host", HOST_TOTAL, readings, failed_at=readings[-1].t + 30).headroom()
    assert room is not None and room.trend.at(room.t) < 0 and room.falling_below_zero
    text = room.describe()
    assert not NEGATIVE_MIB.search(text) and "below its" not in text, text
    assert text == "its host readings were falling, which says nothing of the host's 23.5 GiB", text
    found = attribute(readings, Evidence(), 16, limit=Limit("host", HOST_TOTAL, readings, readings[-1].t + 30))
    assert not NEGATIVE_MIB.search(found.summary) and "below its" not in found.summary, found.summary
    assert found.figures["trend_at_failure_bytes"] is None and found.figures["below_limit_bytes"] is None
    assert found.figures["rise_bytes"] is None and found.figures["limit_bytes"] == HOST_TOTAL


@pytest.mark.parametrize(("limit_mib", "words"), [(400, "140.0 MiB below the cgroup limit of 400.0 MiB"),
                                                  (260, "had reached the cgroup limit of 260.0 MiB"),
                                                  (250, "had passed the cgroup limit of 250.0 MiB")])
def test_a_line_at_a_failure_is_told_as_the_line_never_as_memory_below_its_limit(limit_mib: int,
                                                                                words: str) -> None:
    """A steady line that was 140 MiB short of the limit, exactly at it, or past it at the failure."""
    readings = [Reading(10.0 + i, 200 * MIB + i * 2 * MIB, i) for i in range(40)]
    trend = steady_rise(readings)
    assert trend is not None
    room = Headroom("cgroup", limit_mib * MIB, trend, trend.t_last + (260 * MIB - trend.last) / trend.per_s)
    text = room.describe()
    assert words in text and "below its" not in text and text.startswith("its steady rise "), text
    assert not NEGATIVE_MIB.search(text), text


def address_space_oom(limit: int = 1_250_000_000) -> OomProgress:
    found = OomProgress.from_record({"type": "oom", "device": "cpu", "memory": "address_space",
                                     "requested_bytes": 64 * MIB, "allocated_bytes": 1150 * MIB,
                                     "total_bytes": limit, "micro_batch": 16})
    assert found is not None
    return found


def test_a_host_oom_under_rlimit_as_is_told_against_the_address_space_limit_not_the_host() -> None:
    """The issue's run: a host series that fell away (the machine's other jobs) and the probe's
    record of the 1.25 GB address-space limit. The cause names that limit and its figures."""
    watch = TrendWatch()
    watch.series[MACHINE] = falling()
    watch.limits[MACHINE] = HOST_TOTAL
    watch.series[HOST] = [Reading(100.0 + i, 900 * MIB + (i % 3) * MIB, None) for i in range(40)]
    before = watch.attribute(Evidence(), 16, kind=FailureKind.HOST_OOM, failed_at=170.0)
    assert "its host readings were falling" in before.summary  # without the probe's record, the host is what is left
    found = watch.attribute(Evidence(address_space=address_space_oom()), 16, kind=FailureKind.HOST_OOM,
                            failed_at=170.0)
    assert "an allocation of 64 MiB failed against the 1192 MiB address-space limit (RLIMIT_AS); 1150 MiB was " \
           "mapped when the error was seen" in found.summary, found.summary
    assert "host" not in found.summary and not NEGATIVE_MIB.search(found.summary) and "below its" not in found.summary
    assert found.figures["budget"] == "address space (RLIMIT_AS)" and found.figures["limit_bytes"] == 1_250_000_000
    assert (found.figures["requested_bytes"], found.figures["mapped_bytes"]) == (64 * MIB, 1150 * MIB)


def test_a_leak_under_rlimit_as_names_the_address_space_limit_too() -> None:
    rising = [Reading(100.0 + i, 400 * MIB + i * 4 * MIB, i) for i in range(40)]
    found = attribute(rising, Evidence(address_space=address_space_oom()), 16)
    assert found.summary.startswith("leak: worker RSS rose steadily by"), found.summary
    assert "1192 MiB address-space limit (RLIMIT_AS)" in found.summary, found.summary


# --- a crash's evidence is its exception line --------------------------------------------------


CHAINED = textwrap.dedent('''
    def load():
        raise KeyError("shard 7")

    try:
        load()
    except KeyError as exc:
        try:
            raise ValueError("bad data") from exc
        except ValueError:
            raise AssertionError("UnspecializedNNModuleVariable(LM) is already tracked for mutation\\n\\n"
                                 "from user code:\\n   File \\"forward.py\\", line 77, in pre\\n\\n"
                                 "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace")
''')


def scanned(lines: list[str]) -> OutputScanner:
    scan = OutputScanner()
    for line in lines:
        scan.feed(line)
    return scan


def test_the_evidence_of_a_real_chained_traceback_is_its_last_exception_line(tmp_path: Path) -> None:
    (tmp_path / "crash.py").write_text(CHAINED)
    out = subprocess.run([sys.executable, str(tmp_path / "crash.py")], capture_output=True, text=True, timeout=60)
    lines = out.stderr.splitlines(keepends=True)
    assert lines[-1].startswith("Set TORCHDYNAMO_VERBOSE=1") and out.stderr.count("Traceback") == 3
    scan = scanned(["step 1\n", *lines])
    assert scan.exception == "AssertionError: UnspecializedNNModuleVariable(LM) is already tracked for mutation"
    verdict = classify(ExitFacts(out.returncode), scan)
    assert verdict.kind is FailureKind.CRASH
    assert verdict.evidence == "exit code 1: AssertionError: UnspecializedNNModuleVariable(LM) is already " \
                               "tracked for mutation"


def test_a_rank_prefixed_traceback_and_hints_after_it() -> None:
    """torchrun's ``[rank0]:`` prefix, dynamo's trailer lines, then a library's own last words."""
    scan = scanned(["[rank0]: Traceback (most recent call last):\n",
                    '[rank0]:   File "train.py", line 3, in <module>\n',
                    "[rank0]:     model = torch.compile(model, fullgraph=True)\n",
                    "[rank0]: torch._dynamo.exc.Unsupported: Call to `torch._dynamo.graph_break()`\n",
                    "[rank0]: \n", "[rank0]: Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n",
                    "wandb: Synced 5 files\n"])
    assert scan.exception == "torch._dynamo.exc.Unsupported: Call to `torch._dynamo.graph_break()`"
    assert classify(ExitFacts(1), scan).evidence.endswith("graph_break()`")
    assert classify(ExitFacts(1), scanned(["step 1\n", "something went wrong\n"])).evidence == \
        "exit code 1: something went wrong"  # no traceback: the last line is all there is


# --- the program behind wrappers ---------------------------------------------------------------


@pytest.mark.parametrize(("command", "inner"), [
    (["prlimit", "--as=1250000000", "python", "train.py"], ["python", "train.py"]),
    (["env", "A=1", "-u", "B", "python3", "-u", "train.py"], ["python3", "-u", "train.py"]),
    (["nice", "-n", "5", "taskset", "-c", "0-3", "numactl", "--cpunodebind=0", "-m", "0", "python", "t.py"],
     ["python", "t.py"]),
    (["bash", "-c", "cd exp && source env.sh && exec python train.py --bs 4"], ["python", "train.py", "--bs", "4"]),
    (["timeout", "2h", "/usr/bin/env", "python", "x.py"], ["python", "x.py"]),
    (["nice", "-5", "taskset", "0x3", "python"], ["python"]),
    (["prlimit", "--pid", "42", "--as=1"], ["prlimit", "--pid", "42", "--as=1"]),  # acts on another process
    (["bash", "train.sh"], ["bash", "train.sh"]),
])
def test_unwrap_finds_the_program_behind_its_wrappers(command: list[str], inner: list[str]) -> None:
    assert unwrap(command) == inner


def test_a_python_behind_wrappers_is_python() -> None:
    assert not_python(["prlimit", "--as=1250000000", "python", "train.py"]) is None
    assert not_python(["bash", "-c", "python train.py"]) is None
    assert not_python(["env", "X=1", "nice", "-n", "5", "numactl", "-N", "0", "python", "t.py"]) is None
    assert not_python(["bash", "train.sh"]) is None  # a shell script may start Python
    assert not_python(["nice", "-n", "5", "true"]) == "the command (true) is not Python"


# --- the status picture after a restart ----------------------------------------------------------


def test_the_progress_before_the_new_attempts_first_step_is_its_resume_point() -> None:
    old = {"step": 25, "total_steps": 100, "t": 1000.0, "source": "probe", "attempt": 1, "steps_per_s": 4.0}
    current = {"attempt": 2, "started": 1010.0, "checkpoint": "/ck/step-20.pt"}
    resumed = current_progress(old, current, {2: {"path": "/ck/step-20.pt", "step": 20}})
    assert resumed == {"step": 20, "total_steps": 100, "t": 1010.0, "source": "resume_point",
                       "checkpoint": "/ck/step-20.pt", "attempt": 2}
    assert current_progress(old, {**current, "checkpoint": None}, {}) is None  # started over: no step yet
    assert current_progress(old, current, {2: {"step": None}}) is None  # a checkpoint of unknown step
    own = {**old, "attempt": 2, "step": 21}
    assert current_progress(own, current, {2: {"step": 20}}) == own  # the new attempt's own report
    untagged = {k: v for k, v in old.items() if k != "attempt"}  # a journal from before the tag: by time
    assert current_progress(untagged, current, {2: {"step": 20}})["step"] == 20  # type: ignore[index]
    assert current_progress({**untagged, "t": 1011.0}, current, {2: {"step": 20}})["step"] == 25  # type: ignore[index]
