"""What a checkpoint's name says at the edges mutation testing showed unpinned (docs/mutation.md):
a name that is a number alone (a directory per step, ``checkpoints/1000/``) names its step, and a
number the checkpoint's own noun gives with ``=`` is a metric's form, never a step."""

from __future__ import annotations

import pytest

from oomguard.supervisor.observe.ckptname import NameReading, read_name


@pytest.mark.parametrize("name,step", [
    ("1000", 1000),  # a directory per step, named by the step alone
    ("500.pt", 500),
    ("_750.pt", 750),  # a separator and no label: still the name's own number
])
def test_a_number_alone_is_the_step(name: str, step: int) -> None:
    assert read_name(name) == NameReading(step)


@pytest.mark.parametrize("name,step", [
    ("ckpt=12.pt", None),  # "=" is how a metric is written (Lightning's "val_loss=0.53")
    ("model=3.pt", None),
    ("ckpt-12.pt", 12),  # the same noun with "-", "_" or nothing before the number: its own number
    ("ckpt_12.pt", 12),
    ("ckpt12.pt", 12),
])
def test_the_nouns_number_given_with_equals_is_no_step(name: str, step: int | None) -> None:
    assert read_name(name) == NameReading(step)
