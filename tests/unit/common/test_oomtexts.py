"""Every out-of-memory message users meet, classified the same by both classifiers and end to end.

tests/data/oom_corpus.jsonl holds one record per form: the output a failing process prints (its
traceback's last lines), the line that is the evidence, the device, the FailureKind the supervisor
must give it and the kind the worker library must give the exception, and the source file and
version of the library that prints it (docs/oom-messages.md lists them). The supervisor's
classifier reads the output; the worker library's reads the exception; one ``oomguard run`` session
meets every record in turn.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
from support import ROOT

from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, classify
from oomguard.supervisor.distributed.launcher import RankScanner
from oomguard.supervisor.observe.output import OutputScanner

CORPUS = ROOT / "tests" / "data" / "oom_corpus.jsonl"
RECORDS: list[dict[str, Any]] = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
GPU_MEMORY = {"cuda", "rocm", "mps", "xpu"}  # accelerators: a smaller micro-batch needs less of their memory


def case_id(record: dict[str, Any]) -> str:
    return f"{record['id']}[{record['version']}]"


CASES = [pytest.param(r, id=case_id(r)) for r in RECORDS]


def scan(*lines: str) -> OutputScanner:
    s = OutputScanner()
    for line in lines:
        s.feed(line)
    return s


def test_the_corpus_has_every_form_the_issue_names() -> None:
    text = "\n".join(line for r in RECORDS for line in r["output"])
    for needed in (r"^RuntimeError: CUDA out of memory\. Tried to allocate", r"^torch\.OutOfMemoryError: CUDA out",
                   r"^torch\.cuda\.OutOfMemoryError: CUDA out", r"CUDA error: out of memory",
                   r"CUBLAS_STATUS_ALLOC_FAILED", r"CUDNN_STATUS_ALLOC_FAILED", r"CUDNN_STATUS_NOT_INITIALIZED",
                   r"HIP out of memory", r"hipErrorOutOfMemory", r"MPS backend out of memory",
                   r"XPU out of memory", r"DefaultCPUAllocator: can't allocate memory: you tried to allocate \d+",
                   r"\[enforce fail at alloc_cpu\.cpp:114\] \. DefaultCPUAllocator: not enough memory",
                   r"Cuda failure 'out of memory'"):
        assert re.search(needed, text, re.MULTILINE), needed
    for record in RECORDS:
        assert record["source"] and record["version"] and record["evidence"] in record["output"], record["id"]
    assert len({r["id"] for r in RECORDS}) == len(RECORDS)


@pytest.mark.parametrize("record", CASES)
def test_the_supervisor_classifies_the_output(record: dict[str, Any]) -> None:
    frames = ["Traceback (most recent call last):", '  File "train.py", line 17, in train_step', "    loss = f(x)"]
    verdict = classify(ExitFacts(1), scan("step 3 loss 2.1", *frames, *record["output"]))
    assert verdict.kind is FailureKind(record["kind"]), verdict
    if verdict.kind.is_memory:
        assert verdict.evidence == record["evidence"]
    else:
        assert verdict.evidence == f"exit code 1: {record['output'][-1]}"


@pytest.mark.parametrize("record", CASES)
def test_the_device_is_the_kind(record: dict[str, Any]) -> None:
    """Accelerator memory is a CUDA_OOM whatever the accelerator (the remedy is the same: halve);
    the host's is a HOST_OOM."""
    expected = {"cuda_oom": GPU_MEMORY, "host_oom": {"cpu"}, "crash": GPU_MEMORY | {"cpu"}}[record["kind"]]
    assert record["device"] in expected


@pytest.mark.parametrize("record", CASES)
def test_a_rank_under_torchrun_is_read_the_same(record: dict[str, Any]) -> None:
    """torchrun's rank-prefixed output is read with the same texts: rank 1's memory failure is
    recorded with its kind and the same evidence line; a crash records none."""
    ranks = RankScanner()
    for line in record["output"]:
        ranks.feed(f"[rank1]: {line}")
    expected = {1: (record["kind"], record["evidence"])} if record["kind"] != "crash" else {}
    assert ranks.oom == expected


def exception(record: dict[str, Any]) -> BaseException:
    """The exception the process raised, rebuilt from its printed form (``Type: message`` and the
    lines after it, as ``traceback`` prints a multi-line message)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    types: dict[str, type[BaseException]] = {
        "RuntimeError": RuntimeError, "MemoryError": MemoryError, "torch.OutOfMemoryError": torch.OutOfMemoryError,
        "torch.cuda.OutOfMemoryError": torch.cuda.OutOfMemoryError,
        "torch.distributed.DistBackendError": dist.DistBackendError,
        "numpy._core._exceptions._ArrayMemoryError": MemoryError}
    output = record["output"]
    start = next(i for i, line in enumerate(output) if re.match(r"^[\w.]+(?:Error)\b", line))
    name, _, message = output[start].partition(": ")
    return types[name]("\n".join([message, *output[start + 1:]]) if message else "")


@pytest.mark.parametrize("record", CASES)
def test_the_worker_library_agrees(record: dict[str, Any]) -> None:
    from oomguard.worker.outofmemory import classify as worker_classify

    assert worker_classify(exception(record)) == record["worker"]


def test_the_cpu_allocator_message_made_for_real_is_a_host_oom() -> None:
    """The POSIX wording from a real allocation failure under RLIMIT_AS, as the corpus records it."""
    pytest.importorskip("torch")
    code = ("import resource, torch\nresource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))\n"
            "torch.empty(8 * 2**30, dtype=torch.uint8)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    recorded = next(r for r in RECORDS if r["id"] == "cpu-allocator-posix")["evidence"]
    # The same words up to the byte count; the line number in alloc_cpu.cpp moves between versions.
    assert re.sub(r"alloc_cpu\.cpp:\d+", "", last) == re.sub(r"alloc_cpu\.cpp:\d+", "", recorded)
    verdict = classify(ExitFacts(1), scan(*out.stderr.splitlines()))
    assert verdict.kind is FailureKind.HOST_OOM and verdict.evidence == last


def test_the_docs_list_every_record() -> None:
    """docs/oom-messages.md lists each form with its source and classification: none missing."""
    doc = (ROOT / "docs" / "oom-messages.md").read_text()
    for record in RECORDS:
        assert f"- `{record['id']}` ({record['version']}): {record['source']}" in doc, record["id"]
        shown = record["evidence"] if len(record["evidence"]) <= 90 else record["evidence"][:87]
        assert shown in doc and f"| {record['device']} | `{record['kind']}` |" in doc, record["id"]
