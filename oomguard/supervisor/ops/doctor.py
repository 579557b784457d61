"""``oomguard doctor``: checks the machine before a long run, one line per check with the fix.

Each check is a small function of a ``DoctorContext`` returning a ``Check``; nothing here changes
the machine except a probe cgroup that is removed at once. The exit code is 1 when a check failed
(the run would not work as intended), else 0; warnings name what oomguard will do without. Runs of
several ranks and nodes also get the collective backends and the rendezvous endpoint checked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from oomguard.supervisor.lifecycle import UsageError

OK = "ok"
WARN = "warn"
FAIL = "fail"
INFO = "info"

GIB = 1024**3
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
_ALLOC_CONF_KEYS = frozenset({
    "backend", "max_split_size_mb", "roundup_power2_divisions", "max_non_split_rounding_mb",
    "garbage_collection_threshold", "expandable_segments", "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads"})


class DoctorError(UsageError):
    """Bad input to ``oomguard doctor``; one line naming the option and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__("", message)


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK | WARN | FAIL | INFO
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class DoctorContext:
    """Where the checks look; the defaults are the real machine."""

    run_dir: Path = field(default_factory=Path.cwd)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_root: Path = Path("/proc")
    min_free_bytes: int = 10 * GIB
    rdzv_endpoint: str | None = None  # multi-node: node 0's HOST:PORT
    node_rank: int | None = None
    distributed: bool = False  # check the collective backends (implied by rdzv_endpoint)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise DoctorError(f"--port {self.port} is out of range: use 1-65535")
        if self.min_free_bytes < 0:
            raise DoctorError("--min-free-gb must be 0 or more")


# ---------------------------------------------------------------------------------------------
# GPU


def check_nvml(ctx: DoctorContext) -> list[Check]:
    """NVML reachable and the driver version, then one line per GPU with its free memory."""
    try:
        import pynvml
    except ImportError:
        return [Check("nvml", FAIL, "the nvidia-ml-py package is missing", "pip install nvidia-ml-py")]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return [Check("nvml", WARN, f"NVML not reachable ({error}); GPU memory will not be watched, CUDA OOMs "
                      "are still caught", "install the NVIDIA driver; in Docker run with --gpus all (or the "
                      "compose GPU reservation)")]
    try:
        return _nvml_devices(pynvml)
    finally:
        pynvml.nvmlShutdown()


def _nvml_devices(nvml: Any) -> list[Check]:
    driver = _text(nvml.nvmlSystemGetDriverVersion())
    count = nvml.nvmlDeviceGetCount()
    checks = [Check("nvml", OK, f"driver {driver}, {count} GPU(s)")]
    if count == 0:
        checks.append(Check("gpus", WARN, "NVML sees no GPU", "check CUDA_VISIBLE_DEVICES and the container's GPUs"))
    for index in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        name = _text(nvml.nvmlDeviceGetName(handle))
        detail = f"{name}: {memory.free / GIB:.1f} of {memory.total / GIB:.1f} GiB free"
        busy = (memory.free / memory.total if memory.total else 0.0) < 0.9
        fix = "another process holds GPU memory: see nvidia-smi, stop it or pick another GPU" if busy else ""
        checks.append(Check(f"gpu{index}", WARN if busy else OK, detail, fix))
    return checks


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ---------------------------------------------------------------------------------------------
# cgroups, PSI, host memory


def cgroup_version(ctx: DoctorContext) -> str | None:
    """'v2' when the unified hierarchy has the memory controller, 'v1' for a v1 memory mount, else None."""
    controllers = ctx.cgroup_root / "cgroup.controllers"
    if controllers.is_file() and "memory" in controllers.read_text().split():
        return "v2"
    if (ctx.cgroup_root / "memory" / "memory.limit_in_bytes").exists():
        return "v1"
    return None


def own_cgroup_dir(ctx: DoctorContext, version: str) -> Path | None:
    """This process's memory cgroup directory, from ``/proc/self/cgroup``."""
    try:
        lines = (ctx.proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if version == "v2" and controllers == "":
            return ctx.cgroup_root / path.lstrip("/")
        if version == "v1" and "memory" in controllers.split(","):
            return ctx.cgroup_root / "memory" / path.lstrip("/")
    return None


def check_cgroup(ctx: DoctorContext) -> list[Check]:
    version = cgroup_version(ctx)
    if version is None:
        return [Check("cgroup", WARN, "no cgroup memory controller found",
                      "enable the memory controller (cgroup_enable=memory); else --memory-limit watches RSS")]
    parent = own_cgroup_dir(ctx, version)
    if parent is None:
        return [Check("cgroup", WARN, f"cgroup {version}, but this process's memory cgroup is unknown")]
    error = probe_child_cgroup(parent, version)
    if error:
        fix = ("run under a delegated cgroup, e.g. systemd-run --user --scope -p Delegate=yes oomguard run ...; "
               "else --memory-limit falls back to watching RSS" if version == "v2" else
               "run as root or give this user a writable memory cgroup; else --memory-limit watches RSS")
        return [Check("cgroup", WARN, f"cgroup {version} at {parent}; cannot create a limited child: {error}", fix)]
    return [Check("cgroup", OK, f"cgroup {version}; a memory limit can be enforced under {parent}")]


def probe_child_cgroup(parent: Path, version: str) -> str | None:
    """Create a child cgroup with a memory limit and remove it; None on success, else the reason."""
    child = parent / f"oomguard-doctor-{os.getpid()}"
    limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    try:
        child.mkdir()
    except OSError as error:
        return error.strerror or str(error)
    try:
        (child / limit_file).write_text(str(64 * GIB))
    except OSError as error:
        return f"{limit_file}: {error.strerror or error}"
    finally:
        try:
            child.rmdir()  # a cgroup directory is removed with rmdir even though it lists files
        except OSError as error:
            print(f"oomguard doctor: could not remove probe cgroup {child}: {error}", file=sys.stderr)
    return None


def check_psi(ctx: DoctorContext) -> list[Check]:
    path = ctx.proc_root / "pressure" / "memory"
    try:
        first = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return [Check("psi", WARN, "memory pressure (PSI) unavailable", "boot the kernel with psi=1 (Linux 4.20+)")]
    return [Check("psi", OK, f"memory pressure: {first}")]


def check_host_memory(ctx: DoctorContext) -> list[Check]:
    import psutil

    memory = psutil.virtual_memory()
    detail = f"{memory.available / GIB:.1f} of {memory.total / GIB:.1f} GiB available"
    if memory.available < 0.1 * memory.total:
        return [Check("host-memory", WARN, detail, "little host memory is free: stop other jobs first")]
    return [Check("host-memory", OK, detail)]


# ---------------------------------------------------------------------------------------------
# disk, environment, install, port


def check_disk(ctx: DoctorContext) -> list[Check]:
    where = _existing_parent(ctx.run_dir)
    usage = shutil.disk_usage(where)
    detail = f"{usage.free / GIB:.1f} GiB free at {where}"
    if not os.access(where, os.W_OK):
        return [Check("disk", FAIL, f"{where} is not writable", "choose a writable --run-dir")]
    if usage.free < ctx.min_free_bytes:
        return [Check("disk", WARN, detail, "free space or point --run-dir and checkpoints elsewhere "
                      f"(want {ctx.min_free_bytes / GIB:.0f} GiB)")]
    return [Check("disk", OK, detail)]


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_alloc_conf(ctx: DoctorContext) -> list[Check]:
    value = ctx.env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if not value:
        return [Check("alloc-conf", INFO, "PYTORCH_CUDA_ALLOC_CONF unset; oomguard adds expandable_segments:True "
                      "if it sees fragmentation")]
    unknown = [item for item in value.split(",") if item.split(":", 1)[0].strip() not in _ALLOC_CONF_KEYS]
    if unknown or any(":" not in item for item in value.split(",")):
        return [Check("alloc-conf", WARN, f"PYTORCH_CUDA_ALLOC_CONF={value!r} has unknown parts {unknown}",
                      "write key:value pairs separated by commas, e.g. expandable_segments:True")]
    return [Check("alloc-conf", OK, f"PYTORCH_CUDA_ALLOC_CONF={value}")]


def check_shadowing(ctx: DoctorContext) -> list[Check]:
    """oomguard 0.1 installed top-level ``supervisor``/``worker``/``web`` packages; a leftover copy
    shadows supervisord's ``supervisor`` (its ``supervisord`` then fails to start)."""
    ours = Path(__file__).resolve().parents[1]
    packages = (Path(entry or ".") / "supervisor" / "__init__.py" for entry in sys.path)
    found = dict.fromkeys(p.resolve().parent for p in packages if p.is_file())
    stale = [p for p in found if p != ours and any((p / f).is_file() for f in ("launch.py", "loop.py", "run/loop.py"))]
    if stale:
        fix = "remove the old copy (pip uninstall oomguard, then install it again): it shadows supervisord"
        return [Check("import-name", WARN, f"an old oomguard 'supervisor' package is on sys.path: {stale}", fix)]
    return [Check("import-name", OK, f"oomguard imports as 'oomguard' ({ours.parent})")]


def check_port(ctx: DoctorContext) -> list[Check]:
    if (error := _bind_error(ctx.host, ctx.port)) is not None:
        return [Check("port", FAIL, f"dashboard address {ctx.host}:{ctx.port} unavailable: {error.strerror}",
                      f"pass --port with a free port, or find the owner: ss -ltnp 'sport = :{ctx.port}'")]
    return [Check("port", OK, f"dashboard address {ctx.host}:{ctx.port} is free")]


def check_distributed(ctx: DoctorContext) -> list[Check]:
    """Collective backends, and with --rdzv-endpoint the multi-node rendezvous."""
    if not (ctx.distributed or ctx.rdzv_endpoint):
        return []
    gpus = ctx.env.get("CUDA_VISIBLE_DEVICES", "") not in ("", "-1") or Path("/dev/nvidia0").exists()
    checks = [Check("backends", *line) for line in backend_lines(probe_backends(), gpus)]
    if ctx.rdzv_endpoint:
        checks += [Check("rendezvous", *line) for line in rendezvous_lines(ctx.rdzv_endpoint, ctx.node_rank)]
    return checks


CHECKS: tuple[Callable[[DoctorContext], list[Check]], ...] = (
    check_nvml, check_cgroup, check_psi, check_host_memory, check_disk, check_alloc_conf, check_shadowing,
    check_port, check_distributed)


def run_checks(ctx: DoctorContext) -> list[Check]:
    results: list[Check] = []
    for check in CHECKS:
        try:
            results.extend(check(ctx))
        except (OSError, ValueError, RuntimeError) as error:  # one broken probe must not hide the rest
            results.append(Check(check.__name__.removeprefix("check_"), WARN, f"check failed: {error}"))
    return results


def exit_code(results: list[Check]) -> int:
    return 1 if any(check.status == FAIL for check in results) else 0


# ---------------------------------------------------------------------------------------------
# The command line


def add_doctor_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("doctor", help="check this machine before a long run")
    add = parser.add_argument
    add("--run-dir", type=Path, default=Path("."), help="where the run and checkpoints go")
    add("--host", default=DEFAULT_HOST, help="dashboard address to check")
    add("--port", type=int, default=DEFAULT_PORT, help="dashboard port to check")
    add("--min-free-gb", type=float, default=10.0, help="warn below this free disk space")
    add("--json", action="store_true", help="print the checks as JSON")
    add("--distributed", action="store_true", help="check NCCL/Gloo for runs of several ranks")
    add("--rdzv-endpoint", metavar="HOST:PORT",
        help="multi-node: check node 0's rendezvous and oomguard's store (implies --distributed)")
    add("--node-rank", type=int, metavar="R", help="multi-node: this node's rank (0 listens)")
    parser.set_defaults(func=lambda args, command: run_doctor_command(args))


def run_doctor_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run every check and print one line each; 1 if any failed, 2 on bad input."""
    stream = out if out is not None else sys.stdout
    try:
        ctx = DoctorContext(args.run_dir, args.host, args.port, min_free_bytes=int(args.min_free_gb * GIB),
                            rdzv_endpoint=args.rdzv_endpoint, node_rank=args.node_rank, distributed=args.distributed)
    except DoctorError as error:
        print(f"oomguard doctor: error: {error}", file=sys.stderr)
        return 2
    results = run_checks(ctx)
    text = "\n".join(f"[{c.status:^4}] {c.name:<12} {c.detail}" + (f" -- fix: {c.fix}" if c.fix else "")
                     for c in results)
    print(json.dumps([asdict(check) for check in results], indent=2) if args.json else text, file=stream)
    return exit_code(results)


# ``oomguard doctor`` for runs of several ranks and nodes: the collective backends torch has here
# (NCCL for GPUs, Gloo for CPUs), and the rendezvous endpoint every node must reach.
#
# Node 0 needs the rendezvous port (torchrun's c10d store) and the port after it (oomguard's shared
# store) free to listen on; every other node needs to reach both. A refused connection before node 0
# started is a warning, an unreachable or unresolvable host a failure.


_PROBE = """
import json
try:
    import torch
    import torch.distributed as dist
except ImportError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    ok = dist.is_available()
    nccl = ok and dist.is_nccl_available()
    cuda = torch.cuda.is_available()
    version = ".".join(map(str, torch.cuda.nccl.version())) if nccl and cuda else None
    print(json.dumps({"torch": torch.__version__, "distributed": ok, "gloo": ok and dist.is_gloo_available(),
                      "nccl": nccl, "cuda": cuda, "nccl_version": version}))
"""


def probe_backends(python: str = sys.executable, timeout: float = 120.0) -> dict[str, Any]:
    """What torch.distributed offers to the interpreter the ranks use (a child process: importing
    torch into doctor itself would cost its memory for nothing)."""
    out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, check=False)
    lines = out.stdout.strip().splitlines()
    if not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def backend_lines(found: dict[str, Any], gpus: bool) -> list[tuple[str, str, str]]:
    """(status, detail, fix) for the collective backends; pure, so the tests feed it dicts."""
    if "error" in found:
        return [("warn", f"torch.distributed not importable here ({found['error']})",
                 "install torch in the environment the ranks run in")]
    if not found["distributed"]:
        return [("fail", f"torch {found['torch']} was built without torch.distributed",
                 "install a torch build with distributed support")]
    gloo = "gloo available" if found["gloo"] else "gloo missing"
    nccl = f"nccl {found['nccl_version']}" if found.get("nccl_version") else (
        "nccl available" if found["nccl"] else "nccl missing")
    detail = f"torch {found['torch']}: {gloo}, {nccl}"
    if gpus and not found["nccl"]:
        return [("fail", detail + " although GPUs are present", "install a CUDA build of torch (it carries NCCL)")]
    if not found["gloo"] and not found["nccl"]:
        return [("fail", detail, "install a torch build with Gloo or NCCL")]
    return [("ok", detail, "")]


def rendezvous_lines(endpoint: str, node_rank: int | None, timeout: float = 3.0) -> list[tuple[str, str, str]]:
    """Node 0: both ports free to listen on; other nodes: both reachable."""
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit():
        return [("fail", f"--rdzv-endpoint {endpoint!r} is not HOST:PORT", "e.g. node0.cluster:29400")]
    port = int(port_text)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return [("fail", f"rendezvous host {host!r} does not resolve ({exc})", "use node 0's name or address")]
    ports = (port, port + 1)
    if node_rank == 0:
        busy = [p for p in ports if _bind_error("0.0.0.0", p) is not None]
        if busy:
            return [("fail", f"node 0 cannot listen on port(s) {busy} (rendezvous, oomguard's store)",
                     f"pick another --rdzv-endpoint port; find the owner: ss -ltnp 'sport = :{busy[0]}'")]
        return [("ok", f"node 0 can listen on {port} (rendezvous) and {port + 1} (oomguard's store)", "")]
    lines = []
    for p, what in zip(ports, ("rendezvous", "oomguard's store"), strict=True):
        state = _connect(host, p, timeout)
        if state == "open":
            lines.append(("ok", f"{host}:{p} ({what}) is reachable", ""))
        elif state == "refused":
            lines.append(("warn", f"{host}:{p} ({what}) refuses connections: node 0 is not running yet",
                          "start oomguard on node 0 too; this check passes once it runs"))
        else:
            lines.append(("fail", f"{host}:{p} ({what}) cannot be reached ({state})",
                          f"open TCP {port}-{port + 1} between the nodes (firewall, security group)"))
    return lines


def _bind_error(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be listened on, or None."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind((host, port))
    except OSError as error:
        return error
    return None


def _connect(host: str, port: int, timeout: float) -> str:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
