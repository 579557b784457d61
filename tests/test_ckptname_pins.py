"""What a checkpoint's name says at the edges mutation testing showed unpinned (docs/mutation.md):
a name that is a number alone (a directory per step, ``checkpoints/1000/``) names its step, and a
number the checkpoint's own noun gives with ``=`` is a metric's form, never a step."""

from __future__ import annotations

import pytest

from oomguard.supervisor.observe.checkpoints import NameReading, read_name


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
    ("ck-100", 100),  # a user's own word for the checkpoint, set apart: the name's number (tests/workers/causes.py)
    ("gpt_2000.pt", 2000),
    ("ck.100", None),  # "." is no separator a word and its number are written with here
    ("bs-32.pt", None),  # words that name something else: their number is no step
    ("rank_0.pt", None),
    ("seed-42.pt", None),
    ("v-1.ckpt", None),
    ("gpt2.pt", None),  # glued: the word's own number
])
def test_the_nouns_number_given_with_equals_is_no_step(name: str, step: int | None) -> None:
    assert read_name(name) == NameReading(step)


# mutmut leaves a module's constants alone: each entry of ckptname's tables, removed one at a time by
# hand (docs/mutation.md), must change a name's reading. One name per entry the corpus lacks.
@pytest.mark.parametrize("name,step,ordinal", [
    # every label of a step
    ("globalstep1000", 1000, None), ("gs-1000.pt", 1000, None), ("steps_1000", 1000, None),
    ("iters_1000.pth", 1000, None), ("it1000.pt", 1000, None), ("iteration_1000.pt", 1000, None),
    ("iterations-1000", 1000, None), ("update_1000.pt", 1000, None), ("updates_1000.pt", 1000, None),
    ("upd1000.pt", 1000, None),
    # every label of an epoch
    ("epochs_3", None, 3),
    # every noun of the checkpoint's own: its sole number
    ("checkpoints-500", 500, None), ("chkpt_500.pt", 500, None), ("ckpts-500", 500, None),
    ("save_500.pt", 500, None), ("saved-500", 500, None), ("snapshot_500.pt", 500, None),
    ("state_500.pt", 500, None), ("weights_500.pt", 500, None),
    # an extension with a digit of its own is no second number
    ("500.h5", 500, None), ("ckpt-200.hdf5", 200, None),
])
def test_each_label_noun_and_digit_bearing_extension(name: str, step: int | None, ordinal: int | None) -> None:
    assert read_name(name) == NameReading(step, ordinal)
