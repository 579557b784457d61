"""What a checkpoint's name says about its step: only a number the name labels as a step.

A name is a string that only looks like a record, so it is the weakest evidence of a step
(``observe/ckptstep.py`` prefers the probe's save record and the checkpoint's own record). A number
in it is read as the step only where it is labelled as one (``step=500``, ``global_step1000``,
``iter_0001000``, Composer's ``ba100``, fairseq's updates in ``checkpoint_3_1500.pt``) or where it is
the name's only number, unlabelled or named by the checkpoint's own noun (HF's ``checkpoint-500``,
``model_000250.pt``, ``ckpt-12.pt``). Everything else is not a step: an epoch (``epoch=2``,
``ep3``, timm's ``checkpoint-7.pth.tar``), a version (Lightning's ``-v1``), a rank, a batch size
(``bs16``, which oomguard itself changes), a metric (``loss=0.53``), and the numbers of a name that
holds several unlabelled ones. An epoch, or a count of saves (accelerate's ``checkpoint_4``), still
orders the checkpoints of one scheme among themselves: that is ``ordinal``, never reported as a step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Labels that name an optimizer step (or a count of them): Lightning/DeepSpeed/torchtitan ``step``,
# Megatron/mmengine ``iter``, Composer ``ba`` (its batch count: one batch is one optimizer step),
# fairseq ``updates``.
_STEP_LABELS = frozenset({"step", "steps", "globalstep", "gs", "iter", "iters", "iteration", "iterations", "it",
                          "ba", "update", "updates", "upd"})
_EPOCH_LABELS = frozenset({"epoch", "epochs", "ep"})
# The checkpoint's own noun: a number it names is "the checkpoint's number" (HF ``checkpoint-500``).
_NOUNS = frozenset({"checkpoint", "checkpoints", "ckpt", "ckpts", "chkpt", "model", "weights", "state",
                    "snapshot", "save", "saved"})
# Words whose number is something else than the checkpoint's: a sole number after one of these is no
# step even with a separator (``bs-32``, ``rank_0``, ``seed-42``), where a user's own word for the
# checkpoint (``ck-100``, ``gpt_2000``) still gives the name's number.
_NOT_STEPS = frozenset({"bs", "batch", "batchsize", "mb", "micro", "microbatch", "accum", "ga", "rank", "r", "v",
                        "ver", "version", "seed", "gpu", "gpus", "node", "nodes", "world", "fold", "shard", "part",
                        "tp", "pp", "dp", "mp", "lr", "loss", "acc", "top", "layer", "layers", "dim", "of", "best",
                        "last", "latest", "k", "n", "x"})
# Extensions stripped before reading (``.h5`` holds a digit that is no number of the checkpoint's).
_EXTENSIONS = re.compile(r"(\.(pt|pth|tar|ckpt|bin|safetensors|h5|hdf5|pkl|pickle|npz|npy|json|gz|zip|"
                         r"distcp|msgpack|onnx|keras|model|state|pdparams))+$", re.I)
# A number with the letters right before it (its label) and the separator between them; a decimal
# or a scientific number (a metric, a learning rate) is read whole so that it is never a step.
_NUMBER = re.compile(r"(?P<label>[A-Za-z]+)?(?P<sep>[-_=.]?)(?P<num>\d+(?:\.\d+)?(?:e-?\d+)?)")

# Schemes whose sole number is known not to be a step (full name, extension included).
_EPOCH_SCHEMES = (
    re.compile(r"^checkpoint(?P<n>\d+)\.pt$"),         # fairseq: checkpoint{epoch}.pt (checkpoint_utils.py)
    re.compile(r"^checkpoint-(?P<n>\d+)\.pth\.tar$"),  # timm CheckpointSaver: checkpoint-{epoch}.pth.tar
    re.compile(r"^model_(?P<n>[1-9]\d*|0)\.pth$"),     # torchvision references: model_{epoch}.pth (unpadded)
)
_SAVE_COUNT = re.compile(r"^checkpoint_(?P<n>\d+)$")  # accelerate automatic_checkpoint_naming: its save count
_FAIRSEQ_UPDATES = re.compile(r"^checkpoint_(?P<epoch>\d+)_(?P<updates>\d+)\.pt$")  # checkpoint_{epoch}_{updates}.pt


@dataclass(frozen=True)
class NameReading:
    """What a name says: the step (None when it says none) and a number that orders the checkpoints
    of its scheme without being a step (an epoch, a save count)."""

    step: int | None
    ordinal: int | None = None


@dataclass(frozen=True)
class _Number:
    label: str  # lower case, "" when none
    sep: str  # between the label and the number: "", "-", "_", "=" or "."
    text: str

    @property
    def whole(self) -> int | None:
        return int(self.text) if self.text.isdigit() else None


def read_name(name: str) -> NameReading:
    """The step a checkpoint's base name says, where it says one (see the module's docstring)."""
    known = _known_scheme(name)
    if known is not None:
        return known
    numbers = _numbers(_EXTENSIONS.sub("", name))
    steps = {n.whole for n in numbers if n.label in _STEP_LABELS and n.whole is not None}
    epochs = {n.whole for n in numbers if n.label in _EPOCH_LABELS and n.whole is not None}
    ordinal = next(iter(epochs)) if len(epochs) == 1 else None
    if steps:  # two different step labels in one name: which one the trainer counts is unknown
        return NameReading(steps.pop() if len(steps) == 1 else None, ordinal)
    if len(numbers) == 1 and _the_checkpoints_own(numbers[0]):
        return NameReading(numbers[0].whole, ordinal)
    return NameReading(None, ordinal)


def _known_scheme(name: str) -> NameReading | None:
    """A framework's scheme whose numbers the label rules would misread."""
    for scheme in _EPOCH_SCHEMES:
        if m := scheme.match(name):
            return NameReading(None, int(m["n"]))
    if m := _SAVE_COUNT.match(name):
        return NameReading(None, int(m["n"]))
    if m := _FAIRSEQ_UPDATES.match(name):
        return NameReading(int(m["updates"]), int(m["epoch"]))
    return None


def _numbers(stem: str) -> list[_Number]:
    return [_Number((m["label"] or "").lower(), m["sep"], m["num"])
            for m in _NUMBER.finditer(stem)]


def _the_checkpoints_own(number: _Number) -> bool:
    """A name's only number counts as its step when nothing but the checkpoint's noun names it (a
    ``-``, ``_`` or nothing before it), or a word of the user's own set apart by ``-`` or ``_``
    (``ck-100``); a number glued to another word (``r16``, ``gpt2``), given with ``=`` (a metric's
    form) or after a word that names something else (``bs-32``, ``rank_0``) is that word's."""
    if number.whole is None:
        return False
    if not number.label:
        return True
    if number.sep == "=":
        return False
    if number.label in _NOUNS:
        return True
    return number.sep in ("-", "_") and number.label not in _NOT_STEPS and number.label not in _EPOCH_LABELS
