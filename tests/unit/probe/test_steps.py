"""The probe's parts and the supervisor's side of it, without starting processes: the environment,
the step counting rules, the out-of-memory reading, the post-import hook, what status says."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from oomguard.probe import SITE_DIR, start
from oomguard.probe.oom import cpu_oom_request
from oomguard.probe.steps import StepCounter, resumed_step
from oomguard.supervisor.command import not_python
from oomguard.supervisor.config import build_config
from oomguard.supervisor.observe.allocator import ProbeReport
from oomguard.supervisor.record.status import probe_text
from oomguard.supervisor.run.process import with_probe


def test_the_probe_goes_first_on_the_pythonpath_once() -> None:
    assert with_probe("") == SITE_DIR
    assert with_probe(os.pathsep.join(["/a", SITE_DIR, "", "/b"])) == os.pathsep.join([SITE_DIR, "/a", "/b"])
    assert {name for name in os.listdir(SITE_DIR) if name != "__pycache__"} == {"sitecustomize.py"}  # nothing shadowed


def test_no_probe_from_the_config_file(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("micro-batch = 8\ngrad_accum = 1\nprobe = false\n")
    assert build_config({"config": str(toml)}, ["python", "x.py"]).probe is False
    assert build_config({"micro_batch": "8", "grad_accum": "1"}, ["python", "x.py"]).probe is True


class FakeOptimizer:
    def __init__(self, step_in_state: float | None = None) -> None:
        self.param = object()
        self.param_groups = [{"params": [self.param]}]
        self.state: dict[object, dict[str, Any]] = {}
        if step_in_state is not None:
            self.state[self.param] = {"step": torch.tensor(step_in_state)}


def test_one_step_per_iteration_whatever_the_optimizers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OOMGUARD_EVENTS", raising=False)
    counter = StepCounter(torch, every=3600)
    gen, disc, inner = FakeOptimizer(), FakeOptimizer(), FakeOptimizer()
    for _ in range(5):  # a GAN; and a wrapper that steps the inner one (counted on their own, max taken)
        for opt in (disc, gen, inner, inner):
            counter.on_step(opt, (), {})
    assert counter.step == 10  # `inner` stepped twice an iteration: the largest count
    counter.forget()
    assert counter.step == 0


def test_the_resumed_step_comes_from_adam_state_else_the_checkpoint() -> None:
    assert resumed_step(FakeOptimizer(step_in_state=41.0), fallback=7) == 40  # read after its first step here
    assert resumed_step(FakeOptimizer(), fallback=7) == 7


def test_host_out_of_memory_errors_are_told_from_others() -> None:
    text = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
            "to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)")
    assert cpu_oom_request(RuntimeError(text), torch.OutOfMemoryError) == (True, 2**50)
    assert cpu_oom_request(MemoryError(), torch.OutOfMemoryError) == (True, None)
    assert cpu_oom_request(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                           torch.OutOfMemoryError) == (False, None)  # the observer reported it
    assert cpu_oom_request(ValueError("bad shape"), torch.OutOfMemoryError) == (False, None)


def test_the_post_import_hook_runs_after_the_module_and_keeps_its_loader(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "late_module.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    start.after_import("late_module", lambda module: seen.append(module.VALUE))
    assert seen == []
    import late_module  # type: ignore[import-not-found]

    assert seen == [42] and type(late_module.__loader__).__name__ == "SourceFileLoader"
    assert not any(isinstance(f, start.AfterImport) for f in sys.meta_path)  # off once it fired
    start.after_import("late_module", lambda module: seen.append(0))  # already imported: at once
    assert seen == [42, 0]
    sys.modules.pop("late_module")


def test_not_python_from_argv0_and_shebang(tmp_path: Path) -> None:
    script = tmp_path / "launch"
    script.write_text("#!/usr/bin/env python3\n")
    assert not_python([sys.executable, "train.py"]) is None and not_python([str(script)]) is None
    assert not_python(["bash", "-c", "true"]) == "the command (true) is not Python"
    assert not_python(["train.py"]) is None and not_python(["no-such-command-here"]) is None


def test_what_status_says_about_the_probe() -> None:
    report = ProbeReport.for_command(True, not_python(["bash", "-c", "true"]))
    assert probe_text(report.as_meta()) == "none seen: the command (true) is not Python"
    shell = ProbeReport.for_command(True, not_python(["bash", "run.sh"]))  # a shell script may start Python
    assert probe_text(shell.as_meta()) == "none seen: no process has imported torch and taken an optimizer step yet"
    report.take({"type": "probe", "state": "failed", "detail": "OOM observer not attached: x", "pid": 9, "rank": 1})
    assert probe_text(report.as_meta()) == "failed to load: OOM observer not attached: x (the run goes on without it)"
    for pid, rank in ((7, 0), (8, 1)):
        report.take({"type": "probe", "state": "loaded", "detail": "torch 2.5", "pid": pid, "rank": rank})
    assert probe_text(report.as_meta()) == ("loaded in 2 processes (ranks 0, 1); a part failed in 1: "
                                            "OOM observer not attached: x")
    assert probe_text(ProbeReport.for_command(False, None).as_meta()) == "none: turned off (--no-probe)"


def _digest(model: torch.nn.Module, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
            **groups: Any) -> dict[str, Any]:
    from oomguard.probe.steps import fingerprint

    return fingerprint(optimizer(model.parameters(), lr=1e-3, **groups))


def test_the_model_fingerprint_is_what_decides_memory_per_sample() -> None:
    torch.manual_seed(0)
    base = _digest(torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 8)))
    assert (base["params"], base["tensors"], base["optimizer"]) == (64 * 8 + 8 * 8 + 8, 3, "AdamW")
    torch.manual_seed(1)  # other weights, the same model: the same digest
    assert _digest(torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 8)))["digest"] == base["digest"]
    wider = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 8))
    longer = torch.nn.Sequential(torch.nn.Embedding(128, 8), torch.nn.Linear(8, 8))  # a longer position table
    half = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 8)).to(torch.bfloat16)
    frozen = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 8))
    frozen[0].weight.requires_grad_(False)
    others = [_digest(m)["digest"] for m in (wider, longer, half, frozen)]
    same_with_sgd = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 8))
    others.append(_digest(same_with_sgd, torch.optim.SGD)["digest"])
    assert len({base["digest"], *others}) == 6


def test_the_model_record_is_written_at_the_first_step_with_its_optimizer(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from oomguard.common import protocol
    from oomguard.probe import steps

    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("OOMGUARD_EVENTS", str(events))
    counter = StepCounter(torch, every=3600)
    seen: list[object] = []
    counter.first_step = seen.append
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(3):
        counter.on_step(optimizer, (), {})
    assert seen == [optimizer]  # once, with the optimizer that stepped
    steps.report_model(optimizer)

    class Broken:
        @property
        def param_groups(self) -> list[Any]:
            raise RuntimeError("sharded elsewhere")

    steps.report_model(Broken())  # never raises into the program: a probe failure record instead
    records = [protocol.decode(line) for line in events.read_text().splitlines()]
    assert [r["type"] for r in records if r] == ["probe", "step", "model", "probe"]
    written = next(r for r in records if r and r["type"] == "model")
    assert (written["params"], written["tensors"], written["optimizer"], written["pid"]) == (20, 2, "SGD", os.getpid())
    assert written["digest"] == steps.fingerprint(optimizer)["digest"]
    assert records[-1] is not None and records[-1]["state"] == "failed" and "sharded elsewhere" in records[-1]["detail"]


def test_a_process_is_loaded_and_fingerprinted_once_when_its_first_optimizer_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer dropped (an LR finder's, a throwaway warm-up's) empties the count table; the
    next optimizer's first step is not the process's first: no second ``loaded`` nor ``model``."""
    import gc

    monkeypatch.setenv("OOMGUARD_EVENTS", str(tmp_path / "events.jsonl"))
    counter = StepCounter(torch, every=3600)
    seen: list[str] = []
    counter.first_step = lambda optimizer: seen.append(type(optimizer).__name__)  # holds no reference
    throwaway = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    counter.on_step(throwaway, (), {})
    del throwaway
    gc.collect()
    assert not counter._counts
    real = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    counter.on_step(real, (), {})
    assert len(seen) == 1
    loaded = [line for line in (tmp_path / "events.jsonl").read_text().splitlines() if '"loaded"' in line]
    assert len(loaded) == 1
