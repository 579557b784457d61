"""What a checkpoint's name says about its step, on the names real frameworks write.

Each scheme's source is named beside it; a number the name does not label as a step is never one,
and an epoch or a save count orders the checkpoints of its scheme (``ordinal``) without being one."""

from __future__ import annotations

import pytest

from oomguard.supervisor.observe.checkpoints import NameReading, read_name


@pytest.mark.parametrize("name,step,ordinal", [
    # HF Trainer: f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}" (trainer.py), documented as the step
    ("checkpoint-500", 500, None),
    # DeepSpeed engine.save_checkpoint: tag = f"global_step{self.global_steps}"
    ("global_step1000", 1000, None),
    # Megatron-LM checkpointing.get_checkpoint_name: 'iter_{:07d}'.format(iteration)
    ("iter_0001000", 1000, None),
    # torchtitan CheckpointManager: f"step-{step}"
    ("step-1000", 1000, None),
    # detectron2 PeriodicCheckpointer: "{}_{:07d}".format("model", iteration); and a sole number
    ("model_0004999.pth", 4999, None),
    ("model_000250.pt", 250, None),
    ("ckpt-12.pt", 12, None),
    # Lightning ModelCheckpoint default "{epoch}-{step}" with "=" (CHECKPOINT_EQUALS_CHAR)
    ("epoch=2-step=500.ckpt", 500, 2),
    # ... and its version suffix f"{CHECKPOINT_JOIN_CHAR}v{ver}" on a name that exists: v1 is no step
    ("epoch=0-step=100-v1.ckpt", 100, 0),
    ("last-v1.ckpt", None, None),
    ("last.ckpt", None, None),
    ("epoch=3-val_loss=0.53.ckpt", None, 3),  # a metric in the name: its digits are no step
    # Composer CheckpointSaver default filename 'ep{epoch}-ba{batch}-rank{rank}.pt' (ba: batches = steps)
    ("ep1-ba300-rank0.pt", 300, 1),
    ("latest-rank0.pt", None, None),  # its latest_filename 'latest-rank{rank}.pt': the rank is no step
    # accelerate examples: output_dir = f"epoch_{epoch}" (an epoch); f"step_{overall_step}" (batches seen)
    ("epoch_3", None, 3),
    ("step_800", 800, None),
    # accelerate ProjectConfiguration(automatic_checkpoint_naming=True): f"checkpoint_{self.save_iteration}",
    # a count of save_state calls
    ("checkpoint_4", None, 4),
    # fairseq checkpoint_utils.save_checkpoint: "checkpoint{}{}.pt".format(epoch, suffix) at an epoch's
    # end; "checkpoint_{}_{}{}.pt".format(epoch, updates, suffix) every save_interval_updates
    ("checkpoint7.pt", None, 7),
    ("checkpoint_3_1500.pt", 1500, 3),
    ("checkpoint_best.pt", None, None),
    ("checkpoint_last.pt", None, None),
    # timm CheckpointSaver: '-'.join([save_prefix, str(epoch)]) + '.pth.tar'
    ("checkpoint-7.pth.tar", None, 7),
    ("model_best.pth.tar", None, None),
    # torchvision references/classification/train.py: f"model_{epoch}.pth"
    ("model_7.pth", None, 7),
    ("model_0.pth", None, 0),
    # mmengine CheckpointHook: f'epoch_{runner.epoch + 1}.pth' by epoch, f'iter_{runner.iter + 1}.pth' by iter
    ("epoch_12.pth", None, 12),
    ("iter_500.pth", 500, None),
    # a user's own: the batch size (which oomguard halves) and the learning rate are no step
    ("ckpt_step200_bs16.pt", 200, None),
    ("ckpt_step100_bs32.pt", 100, None),
    ("run_lr1e-4_step30.pt", 30, None),
    ("ckpt_bs32.pt", None, None),
    ("model_seed42.pt", None, None),
    ("ckpt_3_7.pt", None, None),  # several unlabelled numbers: which one is the step is unknown
    ("model_r16.pt", None, None),  # a number glued to a word that is no step's label (LoRA's rank)
    ("resnet50_100.pt", None, None),  # not the sole number
    ("step100_iter200.pt", None, None),  # two steps that disagree
    # nanoGPT's out/ckpt.pt and Keras-style names: no step, or an extension's digit only
    ("ckpt.pt", None, None),
    ("model.weights.h5", None, None),
    ("weights.05-0.42.hdf5", None, None),
])
def test_the_step_a_name_says(name: str, step: int | None, ordinal: int | None) -> None:
    assert read_name(name) == NameReading(step, ordinal)
