"""The step matcher against real output: every line captured from Lightning (Rich into a pipe, Rich
rendered, TQDM), the Hugging Face Trainer (its bar with INFO logging, and silent), an Accelerate script,
nanoGPT and nanochat, each labelled with the step it shows (tests/progress_corpus/capture.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from oomguard.supervisor.observe.progress import AttemptWatch, StepMatcher

CORPUS = Path(__file__).resolve().parent / "progress_corpus"
SOURCES = sorted(p.stem for p in CORPUS.glob("*.jsonl"))


def load(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    header, *records = (json.loads(line) for line in (CORPUS / f"{name}.jsonl").read_text().splitlines())
    return header, records


def test_the_corpus_covers_every_framework_and_the_lines_that_fooled_the_matcher() -> None:
    assert {"lightning_rich_pipe", "lightning_rich_terminal", "lightning_tqdm", "hf_trainer_tqdm", "hf_trainer_silent",
            "accelerate_no_trainer", "nanogpt", "nanochat"} <= set(SOURCES)
    lines = [r["line"] for name in SOURCES for r in load(name)[1]]
    for needed in (r"Restoring states from the checkpoint path at \S+/epoch=\d+-step=\d+\.ckpt",
                   r"Saving model checkpoint to \S+/checkpoint-\d+", r"global step \d+",
                   r"Writing model shards: +\d+%", r"Sanity Checking DataLoader", r"'epoch': ",
                   r"Saving current state to \S+/step_\d+", r"Resuming training from",
                   r"Resuming optimization from step"):
        assert any(re.search(needed, line) for line in lines), needed


@pytest.mark.parametrize("name", SOURCES)
def test_every_line_gives_the_step_it_shows_or_none(name: str) -> None:
    header, records = load(name)
    matcher = StepMatcher(batches_per_step=header["batches_per_step"])
    wrong = []
    for record in records:
        seen = matcher.match(record["line"])
        got = (seen.step, seen.total) if seen else None
        expected = (record["step"], record["total"]) if record["step"] is not None else None
        if got != expected:
            wrong.append((record["line"], got, expected))
    assert not wrong, f"{len(wrong)} of {len(records)} lines read wrong, e.g. {wrong[:3]}"


@pytest.mark.parametrize("name", SOURCES)
def test_each_run_ends_at_its_last_step(name: str) -> None:
    """Fed in order, as the output thread does, each run's last step is the highest it showed;
    status ends there."""
    header, records = load(name)
    for run in ("first", "resumed"):
        watch = AttemptWatch(matcher=StepMatcher(batches_per_step=header["batches_per_step"]))
        lines = [r for r in records if r["run"] == run]
        for record in lines:
            watch.feed_line(record["line"])
        steps = [r["step"] for r in lines if r["step"] is not None]
        assert watch.last_step == (max(steps) if steps else None), run
