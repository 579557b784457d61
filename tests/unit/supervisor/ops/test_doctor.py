"""`oomguard doctor` on this real machine, plus the pure parts on made-up inputs."""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
from pathlib import Path

import pytest
from support import oomguard

from oomguard.supervisor.ops import doctor
from oomguard.supervisor.ops.doctor import (
    FAIL,
    INFO,
    OK,
    WARN,
    DoctorContext,
    DoctorError,
    backend_lines,
    rendezvous_lines,
)


def _run(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="oomguard")
    doctor.add_doctor_command(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    code = doctor.run_doctor_command(parser.parse_args(["doctor", *argv]), out)
    return code, out.getvalue()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_check_prints_one_line_with_status(tmp_path: Path) -> None:
    code, out = _run("--run-dir", str(tmp_path), "--port", str(_free_port()), "--min-free-gb", "0")
    lines = out.splitlines()
    names = [line[7:].split()[0] for line in lines]
    for expected in ("nvml", "cgroup", "psi", "host-memory", "disk", "alloc-conf", "import-name", "port"):
        assert expected in names, out
    assert all(line[:6] in ("[ ok ]", "[warn]", "[fail]", "[info]") for line in lines), out
    assert all("-- fix: " in line for line in lines if line.startswith(("[warn]", "[fail]")))
    assert code == (1 if "[fail]" in out else 0)


def test_json_output(tmp_path: Path) -> None:
    _, out = _run("--json", "--run-dir", str(tmp_path), "--port", str(_free_port()))
    checks = json.loads(out)
    assert {"name", "status", "detail", "fix"} <= set(checks[0])


def test_nvml_reports_driver_or_how_to_fix() -> None:
    (first, *_) = doctor.check_nvml(DoctorContext())
    assert first.name == "nvml"
    assert (first.status == OK and "driver" in first.detail) or (first.status == WARN and first.fix)


def test_busy_port_fails_with_the_fix(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code, out = _run("--run-dir", str(tmp_path), "--port", str(port))
    line = next(line for line in out.splitlines() if " port " in line)
    assert line.startswith("[fail]") and "--port" in line
    assert code == 1


def test_cgroup_probe_on_this_machine_leaves_nothing_behind() -> None:
    ctx = DoctorContext()
    (result,) = doctor.check_cgroup(ctx)
    version = doctor.cgroup_version(ctx)
    assert result.status in (OK, WARN)
    if version is not None:
        parent = doctor.own_cgroup_dir(ctx, version)
        assert parent is not None
        assert not list(parent.glob("oomguard-doctor-*"))
    if result.status == WARN:
        assert result.fix


def test_cgroup_version_detection(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert doctor.cgroup_version(DoctorContext(cgroup_root=v2)) == "v2"
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert doctor.cgroup_version(DoctorContext(cgroup_root=v1)) == "v1"
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("4:memory:/a/b\n0::/user.slice/x\n")
    assert doctor.own_cgroup_dir(DoctorContext(cgroup_root=v1, proc_root=proc), "v1") == v1 / "memory" / "a/b"
    assert doctor.own_cgroup_dir(DoctorContext(cgroup_root=v2, proc_root=proc), "v2") == v2 / "user.slice/x"
    assert doctor.cgroup_version(DoctorContext(cgroup_root=tmp_path / "none")) is None


def test_psi_missing(tmp_path: Path) -> None:
    (result,) = doctor.check_psi(DoctorContext(proc_root=tmp_path))
    assert result.status == WARN and "psi=1" in result.fix


def test_disk_space_threshold(tmp_path: Path) -> None:
    (low,) = doctor.check_disk(DoctorContext(run_dir=tmp_path / "not" / "yet", min_free_bytes=2**62))
    assert low.status == WARN and str(tmp_path) in low.detail
    (fine,) = doctor.check_disk(DoctorContext(run_dir=tmp_path, min_free_bytes=0))
    assert fine.status == OK


@pytest.mark.parametrize(
    ("value", "status"),
    [
        ("", INFO),
        ("expandable_segments:True", OK),
        ("max_split_size_mb:128,garbage_collection_threshold:0.6", OK),
        ("expandable_segment:True", WARN),
        ("expandable_segments", WARN),
    ],
)
def test_alloc_conf(value: str, status: str) -> None:
    (result,) = doctor.check_alloc_conf(DoctorContext(env={"PYTORCH_CUDA_ALLOC_CONF": value}))
    assert result.status == status


def test_an_old_oomguard_supervisor_package_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (ours,) = doctor.check_shadowing(DoctorContext())
    assert ours.status == OK
    supervisord = tmp_path / "a" / "supervisor"  # supervisord's own package is no problem any more
    supervisord.mkdir(parents=True)
    (supervisord / "__init__.py").write_text("# supervisord\n")
    (supervisord / "supervisord.py").write_text("")
    monkeypatch.setattr(sys, "path", [*sys.path, str(supervisord.parent)])
    assert [r.status for r in doctor.check_shadowing(DoctorContext())] == [OK]
    old = tmp_path / "b" / "supervisor"  # oomguard 0.1's top-level package, left behind
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("")
    (old / "loop.py").write_text("")
    monkeypatch.setattr(sys, "path", [*sys.path, str(old.parent)])
    results = doctor.check_shadowing(DoctorContext())
    assert any(r.status == WARN and str(old) in r.detail for r in results)


def test_bad_port_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("--port", "70000")[0] == 2
    err = capsys.readouterr().err
    assert "--port" in err and err.count("\n") == 1
    with pytest.raises(DoctorError):
        DoctorContext(port=0)


def test_a_broken_check_does_not_hide_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: DoctorContext) -> list[doctor.Check]:
        raise OSError("boom")

    monkeypatch.setattr(doctor, "CHECKS", (broken, doctor.check_alloc_conf))
    results = doctor.run_checks(DoctorContext(env={}))
    assert [r.status for r in results] == [WARN, INFO]
    assert doctor.exit_code(results) == 0
    assert doctor.exit_code([doctor.Check("x", FAIL, "y")]) == 1


def test_wired_into_the_oomguard_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oomguard.supervisor import cli

    monkeypatch.setattr(cli, "EXTRA_COMMANDS", [doctor.add_doctor_command])
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    code = cli.main(["doctor", "--run-dir", str(tmp_path), "--port", str(_free_port()), "--min-free-gb", "0"])
    assert code in (0, 1) and " import-name " in out.getvalue()


def test_gpu_lines_from_nvml() -> None:
    """The GPU branch with NVML's answers scripted (this machine has no GPU)."""
    from types import SimpleNamespace

    memory = [
        SimpleNamespace(free=79 * 2**30, total=80 * 2**30),
        SimpleNamespace(free=10 * 2**30, total=80 * 2**30),
    ]
    fake = SimpleNamespace(
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: memory[h],
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
    )
    nvml, gpu0, gpu1 = doctor._nvml_devices(fake)
    assert (nvml.status, nvml.detail) == (OK, "driver 550.54.15, 2 GPU(s)")
    assert gpu0.status == OK and "79.0 of 80.0 GiB free" in gpu0.detail
    assert gpu1.status == WARN and "nvidia-smi" in gpu1.fix


# --- merged from tests/test_distcheck.py --------------------------------------------------------------------
# oomguard doctor for several ranks and nodes: backends from the real torch here, the rendezvous
# against real sockets on 127.0.0.1.


def listening_pair() -> tuple[socket.socket, socket.socket, int]:
    """Two listening sockets on PORT and PORT + 1 (the rendezvous and oomguard's store)."""
    while True:
        rdzv, store = socket.socket(), socket.socket()
        rdzv.bind(("127.0.0.1", 0))
        port = rdzv.getsockname()[1]
        try:
            store.bind(("127.0.0.1", port + 1))
        except OSError:
            rdzv.close()
            store.close()
            continue
        rdzv.listen()
        store.listen()
        return rdzv, store, port


def test_doctor_checks_gloo_and_the_rendezvous_of_node_0() -> None:
    rdzv, store, port = listening_pair()
    with rdzv, store:
        out = oomguard("doctor", "--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", "1", timeout=120)
        assert "gloo available" in out.stdout, out.stdout
        assert out.stdout.count("[ ok ] rendezvous   127.0.0.1:") == 2, out.stdout
        # node 0 must listen there itself: taken ports fail with the fix
        busy = rendezvous_lines(f"127.0.0.1:{port}", node_rank=0)
        assert busy[0][0] == "fail" and "cannot listen" in busy[0][1]
    # nothing listens any more: node 0 is not up yet, a warning; node 0 itself may listen now
    assert [s for s, _, _ in rendezvous_lines(f"127.0.0.1:{port}", node_rank=1, timeout=1)] == ["warn", "warn"]
    assert rendezvous_lines(f"127.0.0.1:{port}", node_rank=0)[0][0] == "ok"
    assert rendezvous_lines("no-such-host.invalid:29400", node_rank=1)[0][0] == "fail"


def test_backend_verdicts() -> None:
    cpu = {"torch": "2.13.0+cpu", "distributed": True, "gloo": True, "nccl": False, "nccl_version": None}
    assert backend_lines(cpu, gpus=False)[0][0] == "ok"
    status, detail, fix = backend_lines(cpu, gpus=True)[0]
    assert status == "fail" and "nccl missing" in detail and "CUDA build" in fix
    assert backend_lines({"error": "No module named 'torch'"}, gpus=False)[0][0] == "warn"
