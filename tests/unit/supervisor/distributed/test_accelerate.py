"""``accelerate launch`` read as torchrun is: its flags by accelerate's own parser, its config file
(``--config_file`` or the default location) by accelerate's own loader (pure, fast once imported)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.supervisor.config import build_config
from oomguard.supervisor.distributed.accelerate import default_config_file, parse
from oomguard.supervisor.distributed.torchrun import Shape
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.run.preflight import notices

pytest.importorskip("accelerate")

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 8
num_machines: 2
machine_rank: 1
main_process_ip: node0.cluster
main_process_port: 29555
mixed_precision: bf16
use_cpu: false
"""


def test_flags_give_the_world_and_each_attempt_gets_log_dir_and_no_restarts(tmp_path: Path) -> None:
    launch = parse(["accelerate", "launch", "--multi_gpu", "--num-processes=4", "train.py", "--bs", "{micro_batch}"],
                   env={})
    assert launch is not None and launch.shape == Shape(4, 1, 0, None) and launch.note is None
    argv = launch.attempt_argv(tmp_path)
    assert argv[:4] == ["accelerate", "launch", "--multi_gpu", "--num-processes=4"]
    assert argv[-3:] == ["train.py", "--bs", "{micro_batch}"]
    assert launch.program == ("train.py", "--bs", "{micro_batch}")
    assert argv[argv.index("--log_dir") + 1] == str(tmp_path) and argv[argv.index("--max_restarts") + 1] == "0"
    assert argv.index("--max_restarts") < argv.index("train.py")
    module = parse(["python", "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "-m",
                    "pkg.train", "--x"], env={})
    assert module is not None and module.program == ("-m", "pkg.train", "--x")
    assert parse(["python", "train.py"], env={}) is None


def test_cpu_is_one_process_whatever_num_processes_says(tmp_path: Path) -> None:
    launch = parse(["accelerate", "launch", "--num_processes", "2", "--cpu", "train.py"],
                   env={"HF_HOME": str(tmp_path)})
    assert launch is not None and launch.shape is None
    assert launch.note is not None and "starts one process" in launch.note and "world is 1" in launch.note
    config = build_config({"micro_batch": "4", "global_batch": "16"},
                          ["accelerate", "launch", "--num_processes", "2", "--cpu", "t.py", "--bs", "{micro_batch}",
                           "--ga", "{grad_accum}"])
    assert config.dist_shape is None and config.world_size == 1 and config.initial_plan.grad_accum == 4
    assert notices(config) == [launch.note]  # said at start, in one line


def test_config_file_gives_machines_rank_and_main_process_and_flags_win(tmp_path: Path) -> None:
    path = tmp_path / "multi.yaml"
    path.write_text(CONFIG)
    launch = parse(["accelerate", "launch", "--config_file", str(path), "train.py"], env={})
    assert launch is not None and launch.shape == Shape(4, 2, 1, "node0.cluster:29555")
    flagged = parse(["accelerate", "launch", "--config_file", str(path), "--machine_rank", "0", "--num_processes",
                     "4", "train.py"], env={})
    assert flagged is not None and flagged.shape == Shape(2, 2, 0, "node0.cluster:29555")


def test_the_default_config_is_read_from_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_config_file({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/accelerate/default_config.yaml")
    assert default_config_file({}) == Path.home() / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    where = default_config_file({"HF_HOME": str(tmp_path)})
    where.parent.mkdir(parents=True)
    where.write_text(CONFIG.replace("num_machines: 2", "num_machines: 1").replace("machine_rank: 1", "machine_rank: 0"))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    # the form: world 2 from accelerate, so 64 = 8 × 4 × 2 (not 8 × 8 × 1)
    config = build_config({"micro_batch": "8", "global_batch": "64"},
                          ["accelerate", "launch", "train.py", "--batch_size", "{micro_batch}", "--grad_accum",
                           "{grad_accum}"])
    assert config.world_size == 8 and config.initial_plan.grad_accum == 1
    config = build_config({"micro_batch": "8", "global_batch": "64"},
                          ["accelerate", "launch", "--num_processes", "2", "train.py", "--batch_size", "{micro_batch}",
                           "--grad_accum", "{grad_accum}"])
    assert config.world_size == 2 and config.initial_plan.grad_accum == 4
    # --cpu without --config_file: accelerate does not read the default config, nor does oomguard
    cpu = parse(["accelerate", "launch", "--cpu", "train.py"])
    assert cpu is not None and cpu.shape is None


@pytest.mark.parametrize("words, option, needle", [
    (["--config_file", "{broken}"], "--config_file", "does not load"),
    (["--config_file", "{missing}"], "--config_file", "does not exist"),
    (["--multi_gpu", "--num_processes", "4", "--num_machines", "2", "--machine_rank", "2",
      "--main_process_ip", "h"], "COMMAND", "--machine_rank 2 is not in 0..1"),
    (["--multi_gpu", "--num_processes", "3", "--num_machines", "2", "--main_process_ip", "h"], "COMMAND",
     "not a multiple of --num_machines 2"),
    (["--multi_gpu", "--num_processes", "4", "--num_machines", "2"], "COMMAND", "no --main_process_ip"),
    (["--multi_gpu"], "COMMAND", "no --num_processes"),
    (["--num_processes", "x"], "COMMAND", "invalid int value: 'x'"),
    (["--num_processes", "2", "--mpirun_hostfile", "hosts"], "COMMAND", "MPI launch"),
])
def test_bad_accelerate_input_is_one_line(tmp_path: Path, words: list[str], option: str, needle: str) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: MULTI_GPU\nnum_processes: [2\n")
    words = [w.format(broken=broken, missing=tmp_path / "none.yaml") for w in words]
    with pytest.raises(UsageError) as err:
        build_config({"micro_batch": "4", "grad_accum": "2"},
                     ["accelerate", "launch", *words, "train.py", "--bs", "{micro_batch}", "--ga", "{grad_accum}"])
    assert err.value.option == option and needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_oomguards_own_shape_options_must_agree_with_accelerate() -> None:
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "t.py", "--bs", "{micro_batch}",
               "--ga", "{grad_accum}"]
    assert build_config({"micro_batch": "4", "grad_accum": "2", "nproc_per_node": "2"}, command).world_size == 2
    with pytest.raises(UsageError, match="--nproc-per-node: 4 disagrees with accelerate launch's 2"):
        build_config({"micro_batch": "4", "grad_accum": "2", "nproc_per_node": "4"}, command)


@pytest.mark.parametrize("command, needle", [
    (["torchrun", "--nnodes", "1:4", "--node_rank", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29500",
      "t.py"], "--node-rank: is given with the elastic --nnodes 1:4"),
    (["accelerate", "launch", "--config_file", "{broken}", "t.py"], "--config_file: accelerate's config"),
    (["accelerate", "launch", "--multi_gpu", "--num_processes", "4", "--num_machines", "2", "--machine_rank", "2",
      "--main_process_ip", "h", "t.py"], "COMMAND: accelerate launch --machine_rank 2 is not in 0..1"),
])
def test_the_cli_says_each_bad_form_in_one_line_before_anything_runs(tmp_path: Path, command: list[str],
                                                                    needle: str) -> None:
    from support import oomguard

    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: [MULTI_GPU\n")
    command = [w.format(broken=broken) for w in command]
    out = oomguard("run", "--run-dir", str(tmp_path / "run"), "--no-web", "--micro-batch", "4", "--grad-accum", "2",
                   "--", *command, "--bs", "{micro_batch}", "--ga", "{grad_accum}")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"oomguard: error: {needle}")
    assert not (tmp_path / "run").exists()  # nothing ran: not even the run directory was made
