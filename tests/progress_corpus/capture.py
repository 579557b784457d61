"""Capture the progress corpus: real output of real frameworks, each line with the step it shows.

Each source is run for real on CPU, as oomguard runs a worker (stdout and stderr into one pipe, no
terminal, ``PYTHONUNBUFFERED=1``), once from scratch and once resumed from a checkpoint of the first
run; the output is cut into lines as oomguard's ``LineSplitter`` cuts it (``\\n``, ``\\r\\n`` and a
bare ``\\r`` each end one). Each line is then labelled with the training step it shows, by a rule
written for that one source from what it prints (``label_*`` below), independently of the matcher
under test: a step where the line is the training loop's progress, None everywhere else (paths, file
names, checkpoint and resume messages, evaluation bars, logging dicts). A source's ``.jsonl`` starts
with a header (the command, the versions, the accumulation its bars count batches of), then one
record per distinct line. tests/unit/supervisor/observe/test_progress.py checks ``StepMatcher`` on every line.

    .venv/bin/python tests/progress_corpus/capture.py [--nanogpt DIR] [--nanochat DIR --nanochat-deps DIR]

Lightning, transformers and accelerate come from the environment; nanoGPT and nanochat are run from
checkouts of their repositories (nanochat's own dependencies, rustbpe, tiktoken, pyarrow and wandb,
from a ``pip install --target`` directory). Sources whose inputs are missing are skipped.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PY = sys.executable
MAX_LINES = 400  # per run, distinct lines, in order
_BREAK = re.compile(r"\r\n|\r|\n")
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")

Label = tuple[int, int | None] | None


# --- labels: one rule per source, from what that source prints ---------------------------------


def label_lightning(accum: int) -> Callable[[str], Label]:
    """Lightning's training bar counts batches within an epoch; its checkpoints count optimizer
    steps (batches / accumulation). Rich: "Epoch 2/2 ━━━ 8/8 0:00:04 • ..."; TQDM: "Epoch 2:  50%|█ | 4/8 [".
    Its validation and sanity-check bars, and everything else, show no training step."""

    def label(line: str) -> Label:
        text = _ANSI.sub("", line)
        if m := re.match(r"^Epoch (\d+)/(\d+)\s+\S*\s*(\d+)/(\d+) ", text):
            epoch, last, batch, per_epoch = map(int, m.groups())
            return (epoch * per_epoch + batch) // accum, (last + 1) * per_epoch // accum
        if m := re.match(r"^Epoch (\d+): .*\|\s*(\d+)/(\d+) \[", text):
            epoch, batch, per_epoch = map(int, m.groups())
            return (epoch * per_epoch + batch) // accum, None
        return None

    return label


def label_bar(total_steps: int) -> Callable[[str], Label]:
    """The Hugging Face Trainer's and an Accelerate script's tqdm bar over the optimizer steps,
    " 33%|███▎      | 2/6 [00:03<00:07,  1.81s/it]" (a log line may follow on the same line): its
    position. Their logging dicts, checkpoint messages and the model-shard writer's bar show none."""

    def label(line: str) -> Label:
        if m := re.match(r"^\s*\d+%\|[^|]*\|\s*(\d+)/(\d+) \[", line):
            step, total = int(m.group(1)), int(m.group(2))
            return (step, total) if total == total_steps else None
        return None

    return label


def label_nanogpt(line: str) -> Label:
    """nanoGPT: "iter 12: loss 3.21, time 41.23ms, mfu -100.00%" and "step 10: train loss 3.9, val loss 3.9"."""
    m = re.match(r"^(?:iter|step) (\d+): ", line)
    return (int(m.group(1)), None) if m else None


def label_nanochat(line: str) -> Label:
    """nanochat: "step 00004/00008 (50.00%) | loss: ..." and "Step 00004 | Validation bpb: ..."."""
    if m := re.match(r"^step (\d+)/(\d+) \(", line):
        return int(m.group(1)), int(m.group(2))
    if m := re.match(r"^Step (\d+) \| ", line):
        return int(m.group(1)), None
    return None


# --- running a source -------------------------------------------------------------------------


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> list[str]:
    """The lines of one run's merged output, as oomguard's LineSplitter hands them on."""
    out = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, timeout=timeout, check=False)
    text = out.stdout.decode("utf-8", "replace")
    if out.returncode != 0:
        raise RuntimeError(f"{argv} exited {out.returncode}:\n{text[-3000:]}")
    return [line for line in _BREAK.split(text) if line.strip()]


def distinct(lines: list[str]) -> list[str]:
    seen: set[str] = set()
    kept = []
    for line in lines:
        if line not in seen:
            seen.add(line)
            kept.append(line)
    return kept[:MAX_LINES]


def write(name: str, header: dict[str, object], runs: dict[str, list[str]], label: Callable[[str], Label]) -> None:
    path = HERE / f"{name}.jsonl"
    with path.open("w") as fh:
        fh.write(json.dumps({"source": name, **header}, ensure_ascii=False) + "\n")
        for run_name, lines in runs.items():
            for line in distinct(lines):
                seen = label(line)
                fh.write(json.dumps({"run": run_name, "line": line, "step": seen[0] if seen else None,
                                     "total": seen[1] if seen else None}, ensure_ascii=False) + "\n")
    steps = sum(1 for lines in runs.values() for line in distinct(lines) if label(line))
    print(f"{path.relative_to(ROOT)}: {sum(len(distinct(v)) for v in runs.values())} lines, {steps} with a step")


def shown(argv: list[str]) -> str:
    """A command as the header records it: the script relative to the repository."""
    return " ".join([str(Path(argv[1]).relative_to(ROOT)), *argv[2:]])


def versions(*names: str) -> dict[str, str]:
    return {n: importlib.metadata.version(n) for n in names}


def capture_lightning(work: Path) -> None:
    script = str(ROOT / "examples" / "train_lightning_cli.py")
    base = [PY, script, "fit", "--data.batch_size", "16", "--data.val_samples", "32",
            "--trainer.accumulate_grad_batches", "2", "--data.samples", "64"]
    variants = {
        "lightning_rich_pipe": ([], {}),  # the default with rich installed: drawn only at the end
        "lightning_rich_terminal": ([], {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "120"}),
        "lightning_tqdm": (["--trainer.callbacks", "lightning.pytorch.callbacks.TQDMProgressBar"], {}),
    }
    for name, (extra, env) in variants.items():
        d = work / name
        d.mkdir()
        first = run(base + extra + ["--trainer.max_epochs", "2"], d, env)
        (ckpt,) = sorted(d.glob("lightning_logs/version_0/checkpoints/*.ckpt"))
        resumed = run(base + extra + ["--trainer.max_epochs", "3", "--ckpt_path", str(ckpt)], d, env)
        write(name, {"command": shown(base + extra), "env": env, "batches_per_step": 2,
                     "versions": versions("lightning", "torch", "rich", "tqdm")},
              {"first": first, "resumed": resumed}, label_lightning(2))


def capture_hf(work: Path) -> None:
    script = str(ROOT / "examples" / "train_hf_trainer.py")
    base = [PY, script, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--output_dir", "out", "--save_steps", "2", "--save_total_limit", "2", "--quiet"]
    variants = {
        "hf_trainer_tqdm": ["--log_level", "info"],  # as HF's example scripts set it: INFO from the Trainer
        "hf_trainer_silent": ["--disable_tqdm", "--logging_steps", "3"],
    }
    for name, extra in variants.items():
        d = work / name
        d.mkdir()
        first = run(base + extra + ["--max_steps", "4"], d)
        resumed = run(base + extra + ["--max_steps", "6", "--resume_from_checkpoint", "out/checkpoint-4"], d)
        write(name, {"command": shown(base + extra), "batches_per_step": 2,
                     "versions": versions("transformers", "accelerate", "torch", "tqdm")},
              {"first": first, "resumed": resumed}, lambda line: label_bar(4)(line) or label_bar(6)(line))


def capture_accelerate(work: Path) -> None:
    script = str(HERE / "accelerate_no_trainer.py")
    d = work / "accelerate"
    d.mkdir()
    first = run([PY, script, "--num_train_epochs", "2"], d)  # 12 optimizer steps
    resumed = run([PY, script, "--num_train_epochs", "3", "--resume_from_checkpoint", "out/step_9"], d)  # 18
    write("accelerate_no_trainer", {"command": "accelerate_no_trainer.py", "batches_per_step": 2,
                                    "versions": versions("accelerate", "torch", "tqdm")},
          {"first": first, "resumed": resumed}, lambda line: label_bar(12)(line) or label_bar(18)(line))


def checkout(source: Path, dest: Path) -> str:
    """A working copy of ``source`` (a checkout, or a bare git directory) at ``dest``; its commit."""
    git = ["git", f"--git-dir={source}"] if (source / "objects").is_dir() else ["git", "-C", str(source)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    if (source / "objects").is_dir():
        dest.mkdir()
        archive = subprocess.run([*git, "archive", "HEAD"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        shutil.copytree(source, dest)
    return commit


def capture_nanogpt(work: Path, source: Path) -> None:
    d = work / "nanogpt"
    commit = checkout(source, d)
    data = d / "data" / "shakespeare_char"
    text = "".join(p.read_text(errors="replace") for p in sorted(Path(os.__file__).parent.glob("[a-c]*.py")))
    (data / "input.txt").write_text(text[:400_000])  # prepare.py downloads Shakespeare only when this is missing
    run([PY, "prepare.py"], data)
    args = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
            "--eval_iters=2", "--log_interval=1", "--block_size=32", "--batch_size=4", "--n_layer=2", "--n_head=2",
            "--n_embd=32", "--dropout=0.0", "--eval_interval=5", "--always_save_checkpoint=True"]
    first = run([PY, "train.py", *args, "--max_iters=10", "--lr_decay_iters=10"], d)
    resumed = run([PY, "train.py", *args, "--max_iters=16", "--lr_decay_iters=16", "--init_from=resume"], d)
    write("nanogpt", {"command": "train.py " + " ".join(args), "repository": "karpathy/nanoGPT", "commit": commit,
                      "batches_per_step": 1, "versions": versions("torch")},
          {"first": first, "resumed": resumed}, label_nanogpt)


def capture_nanochat(work: Path, source: Path, deps: Path) -> None:
    import pyarrow as pa  # from deps, put on sys.path by main
    import pyarrow.parquet as pq

    d = work / "nanochat"
    commit = checkout(source, d)
    base = work / "nanochat-base"
    shards = base / "base_data_climbmix"
    shards.mkdir(parents=True)
    # documents the size of web pages, in row groups as the real shards have them (the last shard is
    # the validation split); whole source files as documents make its best-fit packer crawl
    text = "".join(p.read_text(errors="replace") for p in sorted(Path(os.__file__).parent.glob("*.py"))[:200])
    docs = [text[i:i + 1000] for i in range(0, len(text), 1000)][:2400]
    for i, part in enumerate((docs[:2000], docs[2000:])):
        pq.write_table(pa.table({"text": part}), shards / f"shard_{i:05d}.parquet", row_group_size=200)
    # TORCHDYNAMO_DISABLE: torch.compile's C++ build takes many minutes on a small CPU box, and
    # changes nothing nanochat prints
    env = {"NANOCHAT_BASE_DIR": str(base), "PYTHONPATH": f"{d}:{deps}", "WANDB_MODE": "disabled",
           "TORCHDYNAMO_DISABLE": "1"}
    run([PY, "-m", "scripts.tok_train", "--max-chars=2000000", "--vocab-size=512"], d, env)
    args = ["--device-type=cpu", "--depth=2", "--max-seq-len=64", "--device-batch-size=2", "--total-batch-size=256",
            "--eval-every=4", "--eval-tokens=512", "--core-metric-every=-1", "--sample-every=-1",
            "--window-pattern=L", "--save-every=4", "--run=dummy"]
    first = run([PY, "-m", "scripts.base_train", *args, "--num-iterations=8"], d, env)
    resumed = run([PY, "-m", "scripts.base_train", *args, "--num-iterations=8", "--resume-from-step=4"], d, env)
    write("nanochat", {"command": "python -m scripts.base_train " + " ".join(args), "repository": "karpathy/nanochat",
                       "commit": commit, "batches_per_step": 1, "versions": versions("torch")},
          {"first": first, "resumed": resumed}, label_nanochat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated: lightning,hf,accelerate,nanogpt,nanochat")
    p.add_argument("--nanogpt", type=Path, help="karpathy/nanoGPT: a checkout or its bare git directory")
    p.add_argument("--nanochat", type=Path, help="karpathy/nanochat: a checkout or its bare git directory")
    p.add_argument("--nanochat-deps", type=Path, help="pip install --target DIR rustbpe tiktoken pyarrow wandb")
    args = p.parse_args()
    only = set(args.only.split(",")) if args.only else {"lightning", "hf", "accelerate", "nanogpt", "nanochat"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "lightning" in only:
            capture_lightning(work)
        if "hf" in only:
            capture_hf(work)
        if "accelerate" in only:
            capture_accelerate(work)
        if "nanogpt" in only and args.nanogpt:
            capture_nanogpt(work, args.nanogpt)
        if "nanochat" in only and args.nanochat and args.nanochat_deps:
            sys.path.append(str(args.nanochat_deps))
            capture_nanochat(work, args.nanochat, args.nanochat_deps)


if __name__ == "__main__":
    main()
