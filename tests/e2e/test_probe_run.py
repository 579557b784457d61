"""The probe through ``oomguard run``: the supervisor puts it into the worker, the journal records
whether it loaded, and ``oomguard status`` says so, or why there is none (turned off, not Python)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support import oomguard, status

FAST = ["--no-web", "--backoff", "0.05", "--max-backoff", "0.2", "--micro-batch", "4", "--grad-accum", "1"]
LOOP = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters())
for step in range(1, 13):
    opt.zero_grad(); model(torch.randn(4, 4)).sum().backward(); opt.step()
print("last step", step)
"""


def supervise(tmp: Path, *args: str) -> tuple[dict[str, object], str]:
    run_dir = tmp / "run"
    out = oomguard("run", "--run-dir", str(run_dir), *FAST, *args, cwd=tmp, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = oomguard("status", "--run-dir", str(run_dir))
    assert text.returncode == 0, text.stderr
    return status(run_dir), text.stdout


def test_the_probe_is_loaded_into_the_worker_and_counts_its_steps(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LOOP)
    doc, text = supervise(tmp_path, "--", sys.executable, "train.py", "--batch-size", "{micro_batch}")
    assert doc["probe"] == {"state": "loaded", "why": "", "processes": 1, "ranks": [], "failures": []}
    assert "probe:      loaded in 1 process\n" in text
    channel = [json.loads(line) for line in (tmp_path / "run" / "logs" / "attempt-1.events.jsonl").open()]
    assert [r["step"] for r in channel if r["type"] == "step"][-1] == 12  # the script's own last step


def test_status_says_why_there_is_no_probe(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LOOP)
    doc, text = supervise(tmp_path, "--no-probe", "--", sys.executable, "train.py", "--batch-size", "{micro_batch}")
    assert doc["probe"]["state"] == "off" and "probe:      none: turned off (--no-probe)" in text
    assert not (tmp_path / "run" / "logs" / "attempt-1.events.jsonl").exists()
    (tmp_path / "run").rename(tmp_path / "run-off")
    doc, text = supervise(tmp_path, "--", "bash", "-c", "echo step 1 of batch {micro_batch}")
    assert doc["probe"]["state"] == "none" and "probe:      none seen: the command (echo) is not Python" in text
