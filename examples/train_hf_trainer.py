"""A Hugging Face Trainer script as people write them, supervised by oomguard without a change.

A tiny GPT-2 built from a config (no download), synthetic token data, CPU. The Trainer's own
arguments carry the batch (``--per_device_train_batch_size``, ``--gradient_accumulation_steps``),
it writes ``checkpoint-N/`` directories and resumes with ``--resume_from_checkpoint``. With
``--memory-budget-mb`` the process gets a host memory budget (RLIMIT_AS) once step
``--budget-from-step`` is done: a micro-batch too large for it then fails in PyTorch's real
allocator (``DefaultCPUAllocator: can't allocate memory``) after a checkpoint exists.

    oomguard run --micro-batch 16 --global-batch 32 --checkpoint 'out/checkpoint-*' \\
        --resume-args '--resume_from_checkpoint {checkpoint}' -- \\
        python examples/train_hf_trainer.py --per_device_train_batch_size {micro_batch} \\
        --gradient_accumulation_steps {grad_accum} --output_dir out --memory-budget-mb 300
"""

from __future__ import annotations

import argparse
import resource

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--output_dir", default="out")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--max_steps", type=int, default=6)
    p.add_argument("--save_steps", type=int, default=2)
    p.add_argument("--save_total_limit", type=int, default=None, help="keep only the newest N checkpoints")
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--disable_tqdm", action="store_true", help="no progress bar (usual in batch jobs)")
    p.add_argument("--log_level", default="passive", help="the Trainer's log level, e.g. info")
    p.add_argument("--n_layer", type=int, default=1)
    p.add_argument("--torch_compile", action="store_true", help="the Trainer compiles the model (inductor)")
    p.add_argument("--quiet", action="store_true", help="print nothing of its own")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--memory-budget-mb", type=int, default=0, help="host memory budget (RLIMIT_AS)")
    p.add_argument("--budget-from-step", type=int, default=2)
    return p.parse_args()


class TokenData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Deterministic random tokens: sample i is the same in every attempt."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class MemoryBudget(TrainerCallback):
    """Allow the address space in use after step N plus the budget: allocations beyond it fail."""

    def __init__(self, budget_mb: int, from_step: int) -> None:
        self.budget_mb, self.from_step, self.done = budget_mb, from_step, False

    def on_step_end(self, args: TrainingArguments, state: object, control: object, **kw: object) -> None:
        if self.done or not self.budget_mb or getattr(state, "global_step", 0) < self.from_step:
            return
        vm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
        limit = vm_kb * 1024 + self.budget_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        self.done = True


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    set_seed(0)  # before the model, as HF's example scripts do: its weights are the same in every run
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=32, n_layer=args.n_layer, n_head=2)
    model = GPT2LMHeadModel(config)
    steps_data = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_steps=args.max_steps,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=args.save_total_limit,
        logging_steps=args.logging_steps, disable_tqdm=args.disable_tqdm, log_level=args.log_level,
        report_to="none", use_cpu=True, dataloader_num_workers=0, seed=0, learning_rate=1e-3,
        torch_compile=args.torch_compile,
    )
    say = (lambda text: None) if args.quiet else (lambda text: print(text, flush=True))
    say(f"micro-batch {args.per_device_train_batch_size} x accumulation {args.gradient_accumulation_steps}")
    trainer = Trainer(model=model, args=training, train_dataset=TokenData(steps_data, args.seq_len, args.vocab),
                      callbacks=[MemoryBudget(args.memory_budget_mb, args.budget_from_step)])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    say(f"finished at step {trainer.state.global_step}")


if __name__ == "__main__":
    main()
