"""The probe (oomguard/probe/) in real Python processes started with the supervisor's environment:
it counts exactly the optimizer steps a script takes (a GAN's two optimizers as one iteration, a
resumed Adam from its resumed step), runs the user's own sitecustomize, leaves a program without
torch untouched, and when it cannot load, says so and lets the program run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from probing import last_step, probe_env, records, run_probed, run_script
from support import ROOT

from oomguard.probe import SITE_DIR
from oomguard.supervisor.run.process import with_probe

PLAIN = """
import torch
if __name__ == "__main__":  # the data-loader worker is spawned: it imports torch, never steps
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)), batch_size=4,
                                       num_workers=1, multiprocessing_context="spawn")
    step = 0
    for (x,) in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        step += 1
    print("last step", step)
"""


def test_a_plain_loop_is_counted_exactly_and_data_loader_workers_say_nothing(tmp_path: Path) -> None:
    out = run_script(tmp_path, PLAIN)
    assert "last step 16" in out.stdout
    [loaded] = records(tmp_path, "probe")  # the spawned data-loader worker imported torch, never stepped
    assert loaded["state"] == "loaded" and loaded["rank"] is None and loaded["pid"] != os.getpid()
    steps = records(tmp_path, "step")
    assert last_step(tmp_path) == 16 and sum(r["steps"] for r in steps) == 16
    assert steps[0]["step"] == 1 and steps[0]["seconds"] is None  # the first step at once
    assert all(r["rss_bytes"] > 0 and r["devices"] == {} for r in steps)  # no CUDA here: no device figures
    assert {r["pid"] for r in records(tmp_path)} == {loaded["pid"]}


GAN = """
import torch
gen, disc = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.SGD(disc.parameters(), lr=0.1)
for it in range(1, 10):
    opt_d.zero_grad(); disc(gen(torch.randn(8, 4)).detach()).mean().backward(); opt_d.step()
    opt_g.zero_grad(); (-disc(gen(torch.randn(8, 4)))).mean().backward(); opt_g.step()
print("last step", it)
"""


def test_a_gan_steps_two_optimizers_once_per_iteration(tmp_path: Path) -> None:
    out = run_script(tmp_path, GAN)
    assert "last step 9" in out.stdout
    assert last_step(tmp_path) == 9 and sum(r["steps"] for r in records(tmp_path, "step")) == 9


RESUMABLE = """
import sys, torch
model = torch.nn.Linear(4, 1)
kind, start, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
opt = torch.optim.AdamW(model.parameters()) if kind == "adam" else torch.optim.SGD(model.parameters(), lr=0.1)
if start:
    state = torch.load("ckpt.pt")
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
for step in range(start + 1, start + steps + 1):
    opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")
print("last step", step)
"""


def test_a_resumed_adam_continues_from_its_restored_step(tmp_path: Path) -> None:
    run_script(tmp_path, RESUMABLE, "adam", "0", "5")
    assert last_step(tmp_path) == 5
    (tmp_path / "events.jsonl").unlink()
    # The supervisor's checkpoint step is only the fallback: Adam's own restored state says 5.
    out = run_script(tmp_path, RESUMABLE, "adam", "5", "4", OOMGUARD_CHECKPOINT_STEP="3")
    assert "last step 9" in out.stdout and last_step(tmp_path) == 9
    assert sum(r["steps"] for r in records(tmp_path, "step")) == 4


def test_an_optimizer_without_a_step_in_its_state_continues_from_the_checkpoint_step(tmp_path: Path) -> None:
    run_script(tmp_path, RESUMABLE, "sgd", "0", "5")
    (tmp_path / "events.jsonl").unlink()
    out = run_script(tmp_path, RESUMABLE, "sgd", "5", "4", OOMGUARD_CHECKPOINT_STEP="5")
    assert "last step 9" in out.stdout and last_step(tmp_path) == 9


def test_the_users_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    user = tmp_path / "usersite"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    script = tmp_path / "train.py"
    script.write_text(GAN.replace('print("last step", it)',
                                  'import os, sys, sitecustomize\n'
                                  'print("last step", it, os.environ.get("USER_SITE_RAN"), sitecustomize.__file__)\n'
                                  f'assert sys.path.index({SITE_DIR!r}) < sys.path.index({str(user)!r})'))
    env_path = os.pathsep.join([str(user), str(ROOT)])
    out = run_probed(tmp_path, [sys.executable, str(script)], PYTHONPATH=with_probe(env_path))
    assert f"last step 9 yes {user / 'sitecustomize.py'}" in out.stdout
    assert last_step(tmp_path) == 9


def test_a_program_that_never_imports_torch_is_untouched(tmp_path: Path) -> None:
    out = run_script(tmp_path, "import sys\nprint(sorted(m for m in sys.modules if 'torch' in m or 'probe' in m))\n")
    assert out.stdout.strip() == "['_oomguard_probe', '_oomguard_probe.probe', '_oomguard_probe.probe.start']"
    assert not (tmp_path / "events.jsonl").exists()


def test_a_torch_without_the_step_hook_is_a_failure_record_and_the_program_runs(tmp_path: Path) -> None:
    fake = tmp_path / "oldtorch" / "torch"  # a torch too old for the global optimizer hook
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '1.13.1'\nclass optim:\n    pass\n")
    out = run_probed(tmp_path, [sys.executable, "-c", "import torch; print('ran with', torch.__version__)"],
                     PYTHONPATH=with_probe(os.pathsep.join([str(fake.parent), str(ROOT)])))
    assert "ran with 1.13.1" in out.stdout
    [failed] = records(tmp_path)
    assert failed["type"] == "probe" and failed["state"] == "failed"
    assert "torch 1.13.1 has no global optimizer step hook" in failed["detail"]


def test_a_probe_that_cannot_load_says_so_and_the_program_runs(tmp_path: Path) -> None:
    tree = tmp_path / "install" / "oomguard"  # a broken install of the probe: its start module raises
    shutil.copytree(ROOT / "oomguard" / "probe", tree / "probe")
    (tree / "probe" / "start.py").write_text("raise OSError('disk gone')\n")
    site = str(tree / "probe" / "site")
    out = run_probed(tmp_path, [sys.executable, "-c", GAN], PYTHONPATH=os.pathsep.join([site, str(ROOT)]))
    assert "last step 9" in out.stdout
    [failed] = records(tmp_path)
    assert (failed["state"], failed["detail"]) == ("failed", "the probe did not load: OSError: disk gone")


def test_an_uncaught_cpu_out_of_memory_is_reported_then_raised_as_before(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(GAN.replace('print("last step", it)', "torch.empty(2**50, dtype=torch.uint8)"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=probe_env(tmp_path, OOMGUARD_MICRO_BATCH="8"))
    assert out.returncode == 1 and "DefaultCPUAllocator: can't allocate memory" in out.stderr
    [oom] = records(tmp_path, "oom")
    assert (oom["device"], oom["requested_bytes"], oom["step"], oom["micro_batch"]) == ("cpu", 2**50, 9, 8)
    assert last_step(tmp_path) == 9  # the steps since the last record were written at exit


NANOGPT_SAVES = """
import io, os, sys, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
os.makedirs("out", exist_ok=True)
torch.save(model.state_dict(), "out/init.pt")  # before the first step: a resumed count is not known yet
for it in range(8):
    if it == 3:  # nanoGPT: torch.save to a temp name, then os.replace onto out/ckpt.pt
        torch.save({"model": model.state_dict(), "iter_num": it}, "out/ckpt.pt.tmp")
        os.replace("out/ckpt.pt.tmp", "out/ckpt.pt")
        print("mtime", os.stat("out/ckpt.pt").st_mtime)
    opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
torch.save(model.state_dict(), io.BytesIO())  # into a buffer: no path to report
try:
    torch.save(model.state_dict(), "no/such/dir/x.pt")
except Exception as exc:  # the save's own error reaches the program unchanged
    print("save failed:", type(exc).__name__)
from torch import save
print("wrapped once:", save is torch.save, save.__wrapped__ is torch.serialization.save)
"""


def test_a_checkpoint_save_is_reported_with_the_step_it_was_written_at(tmp_path: Path) -> None:
    """nanoGPT's ``ckpt.pt`` has no step in its name, and step records come at most every half second
    (here likely steps 1 and 8 only, around a save made after three). The probe's ``save`` record
    brackets the file's mtime (renamed from its temp name) with the step counted at the save."""
    from oomguard.supervisor.observe.progress import AttemptWatch

    out = run_script(tmp_path, NANOGPT_SAVES)
    assert "save failed: RuntimeError" in out.stdout and "wrapped once: True True" in out.stdout
    mtime = float(out.stdout.split("mtime ")[1].split()[0])
    first, saved, buffer = records(tmp_path, "save")  # the failed save wrote no record
    assert first["path"] == str(tmp_path / "out" / "init.pt") and first["step"] is None
    assert saved["path"] == str(tmp_path / "out" / "ckpt.pt.tmp") and saved["step"] == 3
    assert saved["started"] - 0.05 <= mtime <= saved["t"] + 0.05
    assert buffer["path"] is None and buffer["step"] == 8
    watch = AttemptWatch()
    for record in records(tmp_path):
        watch.take(record, 0.0)
    # The mtime is the kernel's coarse clock's, a tick before the save began by time.time(): the window's slack.
    assert watch.step_at(mtime) == 3
