"""Every sentence is true (issue 35, part 5), end to end with real processes: the cause of a real
RLIMIT_AS OOM behind ``prlimit`` names the address-space limit the failure met; a real crash's
evidence is its exception line, not the hints printed after it; status's probe line is true behind
wrappers; the report of a run that never took a step says so."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import WORKERS, oomguard, status

from oomguard.supervisor.record.journal import Journal

PY = sys.executable
WRAPPED = str(WORKERS / "wrapped.py")
MIB = 2**20
# No spare interpreters: this file checks no spare, and each spare imports torch again beside the worker
# (spares have their own tests: test_spare*.py, test_ownfault.py, the frameworks' and probe matrices' default runs).
FAST = ["--no-web", "--no-spare", "--backoff", "0.05", "--max-backoff", "0.2", "--sample-interval", "0.2",
        "--grace-period", "5"]
NEGATIVE_MIB = re.compile(r"-\d+(?:\.\d+)? MiB")


def run(tmp: Path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return oomguard("run", "--run-dir", str(tmp / "run"), *FAST, *argv, cwd=tmp, timeout=timeout)


def torch_mapped_bytes() -> int:
    """The address space a Python that imported torch maps (what the limit must leave room above)."""
    code = "import torch, os; print(int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE'))"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return int(out.stdout.strip())


def test_a_real_rlimit_as_oom_behind_prlimit_names_the_address_space_limit(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``prlimit --as`` (the issue's command): each step keeps 3 MiB until PyTorch's CPU allocator
    fails against the address-space limit. The cause names that limit and its figure, never the
    host's or the cgroup's, never negative memory, never "below its" limit at the failure.

    240 MiB above torch: the first step takes about 145 MiB of it at micro-batch 16 and 115 at 8 (the
    batch, the probe, the threads), which leaves some 30 and 40 steps of the leak (320 MiB made 60 and
    70 in each attempt). ``--min-micro-batch 8``: a failure at 8 that is not told as the leak gives up
    there, where the halving went on once (16, 8, 8, 4, 2, 1: six attempts, each a fresh torch)."""
    pytest.importorskip("torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    limit = torch_mapped_bytes() + 240 * MIB
    out = run(tmp_path, "--micro-batch", "16", "--global-batch", "32", "--min-micro-batch", "8", "--max-restarts", "1",
              "--",
              "prlimit", f"--as={limit}", PY, WRAPPED, "leak", "{micro_batch}", "{grad_accum}")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "DefaultCPUAllocator: can't allocate memory" in out.stdout + out.stderr
    causes = Journal(tmp_path / "run", readonly=True).event_data("attribution")
    assert len(causes) >= 2, causes  # each attempt failed against the limit
    figure = f"the {limit / MIB:.0f} MiB address-space limit (RLIMIT_AS)"
    for cause in causes.values():
        summary = cause["summary"]
        assert figure in summary, summary
        assert cause["budget"] == "address space (RLIMIT_AS)" and cause["limit_bytes"] == limit, cause
        assert cause["requested_bytes"] > 0 and 0 < cause["mapped_bytes"] <= limit, cause
        assert not NEGATIVE_MIB.search(summary) and "below its" not in summary, summary
        assert "host" not in summary and "cgroup" not in summary, summary
    doc = status(tmp_path / "run")
    assert all(figure in f["cause"]["summary"] for f in doc["failures"]), doc["failures"]


CRASH = textwrap.dedent('''
    import sys

    def compile_step():
        raise KeyError("LM")

    try:
        compile_step()
    except KeyError as exc:
        # dynamo's way: the message carries "from user code:" and a hint after the exception's first line
        raise AssertionError(
            "UnspecializedNNModuleVariable(LM) is already tracked for mutation\\n\\nfrom user code:\\n"
            '   File "train.py", line 77, in pre\\n\\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace '
            "(please do this especially if you're reporting a bug to PyTorch).") from exc
''')


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two attempts of a real script that crashes before any step (``--max-restarts 1``): one run, read by
    the tests below. Its own empty fit store, as each test's (tests/conftest.py)."""
    tmp = tmp_path_factory.mktemp("crashed")
    (tmp / "train.py").write_text(CRASH)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OOMGUARD_CACHE_DIR", str(tmp / "oomguard-cache"))
        out = run(tmp, "--micro-batch", "4", "--grad-accum", "1", "--max-restarts", "1", "--",
                  PY, "train.py", "{micro_batch}", timeout=120)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    return tmp


def test_a_crash_is_told_by_its_exception_line(crashed: Path) -> None:
    """A real script's chained traceback whose last output line is a hint: the evidence is the
    exception line that ends the last traceback."""
    log = (crashed / "run" / "logs" / "attempt-1.log").read_text()
    assert log.rstrip().splitlines()[-1].startswith("Set TORCHDYNAMO_VERBOSE=1")  # the output's last line
    doc = status(crashed / "run")
    evidence = [f["evidence"] for f in doc["failures"]]
    assert evidence == ["exit code 1: AssertionError: UnspecializedNNModuleVariable(LM) is already tracked "
                        "for mutation"] * 2, evidence


def test_the_report_of_a_run_that_never_took_a_step_says_so_and_no_question_mark(crashed: Path) -> None:
    report = oomguard("report", "--run-dir", str(crashed / "run"))
    assert report.returncode == 0, report.stderr
    assert "?" not in report.stdout and "unknown steps" not in report.stdout, report.stdout
    assert "no step seen in this attempt, none seen redone; the next started over" \
        in report.stdout, report.stdout
    assert "steps lost (redone): 0\n" in report.stdout, report.stdout


def test_a_real_dynamo_crash_is_told_by_its_exception_not_its_hint(tmp_path: Path) -> None:
    """``torch.compile(fullgraph=True)`` over a graph break: dynamo's error, then its hint lines."""
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text(textwrap.dedent('''
        import sys
        import torch

        @torch.compile(fullgraph=True, backend="eager")
        def step(x):
            torch._dynamo.graph_break()
            return x + 1

        step(torch.ones(int(sys.argv[1])))
    '''))
    out = run(tmp_path, "--micro-batch", "4", "--grad-accum", "1", "--max-restarts", "0", "--",
              PY, "train.py", "{micro_batch}")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Set TORCHDYNAMO_VERBOSE=1" in (tmp_path / "run" / "logs" / "attempt-1.log").read_text()
    failure = status(tmp_path / "run")["failures"][0]
    assert failure["evidence"].startswith("exit code 1: torch._dynamo.exc.Unsupported: "), failure
    assert "TORCHDYNAMO_VERBOSE" not in failure["evidence"], failure


def probe_line(tmp: Path) -> tuple[dict[str, object], str]:
    text = oomguard("status", "--run-dir", str(tmp / "run"))
    assert text.returncode == 0, text.stderr
    line = next(line for line in text.stdout.splitlines() if line.startswith("probe:"))
    return status(tmp / "run")["probe"], line


@pytest.mark.parametrize("wrapper", ["prlimit", "bash -c"])
def test_the_probe_loads_behind_wrappers_and_status_says_so(tmp_path: Path, wrapper: str) -> None:
    pytest.importorskip("torch")
    inner = [PY, WRAPPED, "train", "{micro_batch}", "{grad_accum}", "3"]
    command = (["prlimit", "--as=64000000000", *inner] if wrapper == "prlimit"
               else ["bash", "-c", " ".join(inner)])
    out = run(tmp_path, "--micro-batch", "4", "--grad-accum", "1", "--", *command)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    probe, line = probe_line(tmp_path)
    assert probe["state"] == "loaded" and line == "probe:      loaded in 1 process", (probe, line)


def test_status_never_calls_a_wrapped_python_command_not_python(tmp_path: Path) -> None:
    """Python behind env, nice, taskset and prlimit that imports torch but takes no step: no probe
    record yet, and the reason is that, not that the command "is not Python"."""
    pytest.importorskip("torch")
    out = run(tmp_path, "--micro-batch", "4", "--grad-accum", "1", "--", "env", "A=1", "nice", "-n", "1",
              "taskset", "-c", "0", "prlimit", "--as=64000000000", PY, WRAPPED, "idle", "{micro_batch}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    probe, line = probe_line(tmp_path)
    assert probe["state"] == "none" and "is not Python" not in line, line
    assert line == "probe:      none seen: no process has imported torch and taken an optimizer step yet", line


def test_a_probe_that_failed_before_the_first_step_is_said_to_have_failed_and_why(tmp_path: Path) -> None:
    """A ``torch`` without the optimizer hooks the probe needs (a stub package beside the script):
    the probe fails at the program's ``import torch``, before any step, and says why."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('__version__ = "0.0-stub"\n')
    (tmp_path / "train.py").write_text("import sys, torch\nprint('imported', torch.__version__, sys.argv[1])\n")
    out = run(tmp_path, "--micro-batch", "4", "--grad-accum", "1", "--", "prlimit", "--as=64000000000",
              PY, "train.py", "{micro_batch}", timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    probe, line = probe_line(tmp_path)
    assert probe["state"] == "failed", probe
    assert line.startswith("probe:      failed to load: step hook not installed: ") and "0.0-stub" in line, line
    channel = [json.loads(x) for x in (tmp_path / "run" / "logs" / "attempt-1.events.jsonl").open()]
    assert [r["state"] for r in channel if r["type"] == "probe"] == ["failed"]  # none loaded: no step
