"""torchrun's command line, the ranks' root cause and classification across ranks (pure, fast)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from oomguard.supervisor.config import build_config
from oomguard.supervisor.decide.classify import ExitFacts, FailureKind, classify
from oomguard.supervisor.distributed.launcher import RankScanner, read_error_files, root_cause
from oomguard.supervisor.distributed.launcher import attempt_argv as launch_attempt_argv
from oomguard.supervisor.distributed.torchrun import Shape, attempt_argv, parse, shape_of, wrap
from oomguard.supervisor.lifecycle import UsageError
from oomguard.supervisor.observe.output import OutputScanner

# torchrun's own words when rank 1 was SIGKILLed and it then stopped rank 0 (torch 2.x, verbatim)
BLOCK = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_23:18:27
  host      : node7
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 12686)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 12686
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_23:18:27
  host      : node7
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12687)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12687
============================================================"""


def scanner(*texts: str) -> RankScanner:
    scan = RankScanner()
    for text in texts:
        for line in text.splitlines():
            scan.feed(line)
    return scan


def test_parse_reads_every_spelling_of_torchrun_options() -> None:
    cmd = ["torchrun", "--nproc_per_node=4", "--nnodes", "2", "--node-rank=1", "--rdzv_endpoint", "h:29400",
           "--standalone", "train.py", "--lr", "3"]
    t = parse(cmd)
    assert t is not None and (t.nproc_per_node, t.nnodes, t.node_rank, t.rdzv_endpoint) == (4, 2, 1, "h:29400")
    assert t.script == ("train.py", "--lr", "3")
    module = parse(["python3", "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "pkg.train"])
    assert module is not None and module.nproc_per_node == 2 and module.script == ("pkg.train",)
    assert parse(["python", "train.py"]) is None


@pytest.mark.parametrize("cmd, option", [
    (["torchrun", "--nproc-per-node", "auto", "t.py"], "--nproc-per-node"),
    (["torchrun", "--nnodes", "4:1", "t.py"], "--nnodes"),
    (["torchrun", "--bogus", "t.py"], "COMMAND"),
    (["torchrun", "--nproc-per-node", "2"], "COMMAND"),
])
def test_torchrun_commands_oomguard_cannot_keep_exact_are_one_line_errors(cmd: list[str], option: str) -> None:
    with pytest.raises(UsageError) as err:
        shape_of(cmd, None, None, None, None)
    assert err.value.option == option


@pytest.mark.parametrize(("cmd", "program"), [
    (["torchrun", "--nproc-per-node", "2", "train.py", "--bs", "8"], ("train.py", "--bs", "8")),
    (["torchrun", "-m", "pkg.train", "--bs", "8"], ("-m", "pkg.train", "--bs", "8")),
    (["torchrun", "--module", "pkg.train"], ("-m", "pkg.train")),
    (["torchrun", "--no-python", "./trainer", "--bs", "8"], ()),
])
def test_program_is_what_python_would_run(cmd: list[str], program: tuple[str, ...]) -> None:
    """Switches carry no value, so ``-m`` and ``--no-python`` are read by presence (they were missed)."""
    launch = parse(cmd)
    assert launch is not None
    assert launch.program == program


def test_attempt_argv_adds_log_dir_and_no_restarts_of_its_own(tmp_path: Path) -> None:
    t = parse(["torchrun", "--max-restarts", "3", "--nproc-per-node", "2", "t.py", "--x"])
    assert t is not None
    argv = attempt_argv(t, tmp_path, "attempt-2")
    assert argv[:1] == ["torchrun"] and argv[-2:] == ["t.py", "--x"]
    assert argv.count("--max-restarts") == 1 and argv[argv.index("--max-restarts") + 1] == "0"
    assert argv[argv.index("--log-dir") + 1] == str(tmp_path) and "--rdzv-id" in argv


def test_wrap_runs_python_scripts_modules_and_binaries_through_torchrun() -> None:
    one = wrap(["python", "train.py", "--a"], Shape(2)).argv()
    assert one[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--standalone" in one
    assert one[-2:] == ["train.py", "--a"] and one[one.index("--nproc-per-node") + 1] == "2"
    assert "--module" in wrap(["python", "-m", "pkg"], Shape(2)).argv()
    assert "--no-python" in wrap(["./train"], Shape(2)).argv()
    multi = wrap(["python", "t.py"], Shape(1, 2, 1, "node0:29400")).argv()
    assert multi[multi.index("--rdzv-backend") + 1] == "c10d" and "--standalone" not in multi


def test_config_world_size_comes_from_torchrun_and_is_asked_once() -> None:
    cfg = build_config({"micro_batch": "4", "global_batch": "32"}, ["torchrun", "--nproc_per_node=4", "t.py"])
    assert cfg.world_size == 4 and cfg.initial_plan.grad_accum == 2
    cfg = build_config({"micro_batch": "4", "global_batch": "32", "nproc_per_node": "2", "nnodes": "2",
                        "node_rank": "1", "rdzv_endpoint": "h:29400"}, ["python", "t.py"])
    assert cfg.world_size == 4
    with pytest.raises(UsageError, match="--nproc-per-node: 2 disagrees"):
        build_config({"micro_batch": "4", "global_batch": "32", "nproc_per_node": "2"},
                     ["torchrun", "--nproc_per_node=4", "t.py"])
    with pytest.raises(UsageError, match="--rdzv-endpoint"):
        build_config({"micro_batch": "4", "global_batch": "32", "nnodes": "2"}, ["python", "t.py"])
    with pytest.raises(UsageError, match="--world-size"):
        build_config({"micro_batch": "4", "global_batch": "32", "world_size": "3", "nproc_per_node": "2"},
                     ["python", "t.py"])


def test_root_cause_is_the_killed_rank_not_the_one_torchrun_stopped() -> None:
    cause = root_cause(scanner(BLOCK), {})
    assert cause is not None and (cause.rank, cause.local_rank, cause.signal, cause.host) == (1, 1, 9, "node7")


def test_an_oom_beats_the_collective_timeout_it_caused_and_torchruns_guess() -> None:
    # torchrun stamps ranks without error files with the time it noticed them, so its "root cause"
    # can be the rank that only lost its peer; the OOM is the cause.
    block = BLOCK.replace("-9 (pid: 12687)  (SIGKILL)", "1 (pid: 12687)").replace("-15 (pid: 12686)  (SIGTERM)",
                                                                                  "1 (pid: 12686)")
    block = block.replace("rank      : 0 (local_rank: 0)", "rank      : X").replace(
        "rank      : 1 (local_rank: 1)", "rank      : 0 (local_rank: 0)").replace("rank      : X",
                                                                                  "rank      : 1 (local_rank: 1)")
    output = ("[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:64743\n"
              "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    cause = root_cause(scanner(output, block), {})
    assert cause is not None and cause.rank == 1 and cause.oom_kind == "cuda_oom"
    verdict = classify(ExitFacts(1), OutputScanner(), cause, gpus=True)
    assert verdict.kind is FailureKind.CUDA_OOM
    assert verdict.evidence.startswith("rank 1 (local rank 1, GPU 1) on node7: torch.OutOfMemoryError")


def test_error_files_are_read_per_local_rank(tmp_path: Path) -> None:
    rank_dir = tmp_path / "run_abc" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "error.json").write_text(json.dumps({"message": {
        "message": "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 GB",
        "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"}}}))
    (tmp_path / "run_abc" / "attempt_0" / "0").mkdir()
    (tmp_path / "run_abc" / "attempt_0" / "0" / "error.json").write_text('{"message": {"mess')  # torn
    files = read_error_files(tmp_path)
    assert list(files) == [1]
    cause = root_cause(scanner(BLOCK.replace("-9 (pid: 12687)  (SIGKILL)", "1 (pid: 12687)")), files)
    assert cause is not None and cause.source == "error file" and cause.oom_kind == "host_oom"


def test_kernel_kill_of_a_rank_is_host_oom_only_when_the_counter_rose() -> None:
    cause = root_cause(scanner(BLOCK), {})
    facts = ExitFacts(1, oom_kills_before=0, oom_kills_after=1, oom_counter="cgroup /w")
    verdict = classify(facts, OutputScanner(), cause)
    assert verdict.kind is FailureKind.HOST_OOM and verdict.signal == signal.SIGKILL
    assert verdict.evidence.startswith("rank 1 (local rank 1) on node7: killed by the kernel OOM killer")
    limit = classify(ExitFacts(1, 0, 1, "cgroup /w", limit_hit=True), OutputScanner(), cause)
    assert limit.kind is FailureKind.MEMORY_LIMIT
    assert classify(ExitFacts(1, 0, 0), OutputScanner(), cause).kind is FailureKind.KILLED


def test_a_crash_names_the_rank_and_its_error_not_torchruns_banner() -> None:
    block = BLOCK.replace("-9 (pid: 12687)  (SIGKILL)", "1 (pid: 12687)")
    cause = root_cause(scanner("[rank1]: ValueError: bad shard 7\n", block), {})
    verdict = classify(ExitFacts(1), OutputScanner(), cause)
    assert verdict.kind is FailureKind.CRASH and "rank 1" in verdict.evidence
    assert verdict.evidence.endswith("ValueError: bad shard 7")


def test_every_node_picks_the_same_failure_for_a_round() -> None:
    from oomguard.supervisor.distributed.coordination import choose

    reports = {0: {"kind": "killed", "stopped_for_peer": 1, "evidence": "SIGTERM"},
               1: {"kind": "host_oom", "evidence": "rank 1: DefaultCPUAllocator"},
               2: {"kind": "crash", "evidence": "Connection closed by peer"}}
    assert choose(reports) == (1, reports[1])
    assert choose({0: {"kind": None}, 1: {"kind": None}}) is None
    assert choose({0: {"kind": "crash"}, 1: {"kind": "crash"}})[0] == 0  # type: ignore[index]


def test_a_multi_node_torchrun_command_needs_no_node_rank_with_c10d() -> None:
    # PyTorch's Slurm example: the same line on every node, c10d numbers the nodes
    cmd = ["torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_id", "456", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "h:29500", "t.py"]
    shape, launch = shape_of(cmd, None, None, None, None)
    assert shape == Shape(1, 2, None, "h:29500") and launch is not None and launch.get("node-rank") is None
    shape, launch = shape_of(cmd, None, None, 1, None)  # --node-rank stays accepted
    assert shape == Shape(1, 2, 1, "h:29500") and launch is not None and launch.get("node-rank") == "1"
    with pytest.raises(UsageError, match="--nnodes: 3 disagrees"):
        shape_of(cmd, None, 3, 1, None)
    # torchrun's default static rendezvous would make every rank-less node node 0
    static = [w for w in cmd if w not in ("--rdzv_backend", "c10d")]
    with pytest.raises(UsageError, match="--node-rank: is needed with --nnodes 2 and torchrun's static rendezvous"):
        shape_of(static, None, None, None, None)
    # oomguard's own options without a rank: torchrun is told c10d and no rank, and decides the host itself
    shape, launch = shape_of(["python", "t.py"], 1, 2, None, "h:29500")
    argv = launch.argv() if launch is not None else []
    assert shape == Shape(1, 2, None, "h:29500") and "--node-rank" not in argv and "--rdzv-conf" not in argv
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"


@pytest.mark.parametrize("cmd, option, needle", [
    (["torchrun", "--nnodes", "1:4", "--node-rank", "1", "--rdzv-endpoint", "h:1", "t.py"], "--node-rank",
     "elastic"),
    (["torchrun", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "t.py"], "--node-rank",
     "not in 0..1"),
    (["torchrun", "--nnodes", "2", "--rdzv-backend", "c10d", "t.py"], "--rdzv-endpoint", "is needed"),
])
def test_bad_multi_node_forms_are_one_line(cmd: list[str], option: str, needle: str) -> None:
    with pytest.raises(UsageError) as err:
        shape_of(cmd, None, None, None, None)
    assert err.value.option == option and needle in str(err.value) and "\n" not in str(err.value)


def test_rankless_nodes_on_one_machine_elect_the_first_to_bind_and_number_the_rest() -> None:
    """As c10d decides which node hosts its store: the endpoint's host is this machine for both;
    the first to bind keeps the shared decision, the other joins it as node 1."""
    import socket

    from oomguard.supervisor.distributed.coordination import Coordinator, PeerLost

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1]) - 1
    shape = Shape(1, 2, None, f"localhost:{port}")
    first, second = Coordinator(shape, 5.0), Coordinator(shape, 5.0)
    first.connect()
    second.connect()
    assert (first.node, first.leader, second.node, second.leader) == (0, True, 1, False)
    plan = {"plan": {"micro_batch": 4}, "members": list(first.gather())}
    agreed = {**plan, "round": 1, "host": 0}
    assert first.start_round(plan) == agreed and second.start_round({"plan": {}}) == agreed
    second.report_end({"kind": "host_oom"})
    news = first.news()
    assert news is not None and (news.regroup, news.node) == (False, 1)
    third = Coordinator(shape, 5.0)
    with pytest.raises(PeerLost, match="3 nodes joined oomguard's store, more than --nnodes 2"):
        third.connect()


def test_oom_text_without_a_rank_prefix_is_still_the_oom_of_the_blamed_rank() -> None:
    # an OOM before init_process_group: torch.distributed has not prefixed the traceback yet
    block = BLOCK.replace("-9 (pid: 12687)  (SIGKILL)", "1 (pid: 12687)")
    scan = OutputScanner()
    scan.feed("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 GB")
    verdict = classify(ExitFacts(1), scan, root_cause(scanner(block), {}))
    assert verdict.kind is FailureKind.HOST_OOM and verdict.evidence.startswith("rank 1 (local rank 1)")


def test_torchruns_elastic_form_is_accepted_and_each_round_gets_its_own_node_count(tmp_path: Path) -> None:
    """``--nnodes MIN:MAX`` (c10d) was refused; now the world at full strength is MAX nodes, MIN is
    how few the run may go on with, and each round's torchrun is told exactly its nodes (K:K), so
    c10d closes the rendezvous on the world the plan is for."""
    cmd = ["torchrun", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "h:29500", "t.py"]
    shape, launch = shape_of(cmd, None, None, None, None)
    assert shape == Shape(2, 2, None, "h:29500", 1) and shape.elastic and shape.world_size == 4
    assert launch is not None
    argv = launch_attempt_argv(shape, cmd, tmp_path, "attempt-3", 1)
    assert argv[argv.index("--nnodes") + 1] == "1:1" and argv.count("--nnodes") == 1
    fixed, _ = shape_of(["torchrun", "--nnodes", "2:2", *cmd[3:]], None, None, None, None)
    assert fixed is not None and not fixed.elastic and fixed.min_nodes is None
