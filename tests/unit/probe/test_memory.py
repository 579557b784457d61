"""probe/memory.py: the breakdown's figures from torch's own objects, and the
CUDA snapshot's edge faked (no GPU here: tests/e2e/test_memory_snapshot_gpu.py runs the real one)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from oomguard.probe import memory as parts  # noqa: E402


def size(t: Any) -> int:
    return int(t.numel() * t.element_size())


def trained(kind: str) -> tuple[Any, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if kind == "frozen":
        model[0].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1, momentum=0.9) if kind == "sgd" else torch.optim.AdamW(trainable)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("kind", ["adamw", "sgd", "frozen"])
def test_the_model_parts_are_the_bytes_of_its_own_tensors(kind: str) -> None:
    model, opt = trained(kind)
    found = parts.model_parts(torch, "cpu", model.modules(), [opt])
    assert found["weights"] == sum(size(p) for p in model.parameters())
    assert found["frozen_weights"] == sum(size(p) for p in model.parameters() if not p.requires_grad)
    assert found["gradients"] == sum(size(p.grad) for p in model.parameters() if p.grad is not None)
    assert found["optimizer_state"] == sum(size(v) for s in opt.state.values() for v in s.values())
    assert found["optimizers"] == ["SGD" if kind == "sgd" else "AdamW"]
    assert parts.model_parts(torch, "cuda:0", model.modules(), [opt])["weights"] == 0  # another device's


def test_a_tied_weight_counts_once_and_the_walk_finds_modules_and_optimizers() -> None:
    model, opt = trained("adamw")
    model[1].weight = model[1].weight  # the same Parameter twice through two names
    modules, optimizers = parts.find(torch)
    assert any(m is model for m in modules) and any(o is opt for o in optimizers)
    tied = torch.nn.Linear(4, 4, bias=False)
    holder = torch.nn.ModuleList([tied, torch.nn.Linear(4, 4, bias=False)])
    holder[1].weight = tied.weight
    assert parts.model_parts(torch, "cpu", holder.modules(), [])["weights"] == 4 * 4 * 4


def test_host_activations_are_the_rest_and_never_negative() -> None:
    fixed = {"weights": 10, "frozen_weights": 0, "gradients": 10, "optimizer_state": 20, "optimizers": []}
    figures = parts.host_figures(fixed, "address_space", 1000, 2000, (500, 100))
    assert figures["activations"] == 1000 - 500 - 40 and figures["baseline"] == 500
    assert figures["limit_kind"] == "RLIMIT_AS" and figures["cache"] is None
    assert parts.host_figures(fixed, "rss", 120, None, (500, 100))["activations"] is None  # 120 - 100 - 40 < 0
    assert parts.host_figures(fixed, "rss", 120, None, None)["activations"] is None


def test_at_the_peak_a_cpu_process_says_its_parts_once_it_stepped_and_never_after_an_oom(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    channel = tmp_path / "events"
    monkeypatch.setenv("OOMGUARD_EVENTS", str(channel))
    model, opt = trained("sgd")
    reporter = parts.BreakdownReporter(torch, lambda: [opt], lambda: model)
    reporter.at_peak_safely()
    assert not channel.exists()  # no first step seen: nothing to split
    reporter.at_first_step(opt)
    reporter.at_peak_safely()
    (record,) = [json.loads(line) for line in channel.read_text().splitlines()]
    assert record["type"] == "memory" and record["at"] == "peak" and record["device"] == "cpu"
    assert record["optimizer_state"] == record["weights"] == record["gradients"] > 0
    reporter.at_host_oom(64, "rss", 10**9, None)
    reporter.at_peak_safely()
    records = [json.loads(line) for line in channel.read_text().splitlines()]
    assert [r["at"] for r in records] == ["peak", "oom"] and records[1]["requested"] == 64


class FakeMemory:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap
        self.recorded: list[dict[str, Any]] = []

    def _record_memory_history(self, **kwargs: Any) -> None:
        self.recorded.append(kwargs)

    def _snapshot(self) -> dict[str, Any]:
        return self.snap


SNAP = {"segments": [{"blocks": [
    {"state": "active_allocated", "size": 512, "requested_size": 500,
     "frames": [{"filename": "/x/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
                {"filename": "/home/u/train.py", "line": 42, "name": "step"}]},
    {"state": "active_allocated", "size": 2048,
     "frames": [{"filename": "/home/u/train.py", "line": 7, "name": "main"}]},
    {"state": "inactive", "size": 4096, "frames": []}]}]}


def test_the_snapshot_is_recorded_only_after_a_cuda_oom_and_saved_at_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = FakeMemory(SNAP)
    fake = SimpleNamespace(cuda=SimpleNamespace(memory=memory, _lazy_call=lambda f: f()))
    folder = str(tmp_path / "memory")
    first = parts.Snapshots(fake, folder, 1)
    assert not parts.armed(folder, 1) and first.at_oom(0) == {"snapshot": None}  # leaves the marker only
    assert parts.armed(folder, 2) and not parts.armed(folder, 3)
    monkeypatch.setenv("OOMGUARD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("OOMGUARD_ATTEMPT", "2")
    monkeypatch.setenv("RANK", "1")
    at_oom = parts.install_snapshots(fake)
    assert memory.recorded == [{"max_entries": parts.MAX_ENTRIES, "stacks": "python"}]
    more = at_oom(0)
    assert more["snapshot"] == f"{folder}/snapshot-attempt2-rank1.pickle"
    assert pickle.loads(Path(more["snapshot"]).read_bytes()) == SNAP  # what memory_viz opens
    assert more["stacks"] == [{"where": "/home/u/train.py:7 in main", "bytes": 2048, "allocations": 1},
                              {"where": "/home/u/train.py:42 in step", "bytes": 500, "allocations": 1}]
    monkeypatch.setenv("OOMGUARD_MEMORY_SNAPSHOT", "off")
    assert not parts.armed(folder, 2) and at_oom(0) == {}
