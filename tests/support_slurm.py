"""A real Slurm on this machine for the tests: Debian's slurm-wlm (scripts/test.sh installs it), one
``slurmctld`` and two ``slurmd`` on this host (Debian builds Slurm with multiple-slurmd support: nodes
n1 and n2, each on a port of its own, started as ``slurmd -N n1``), authenticated by a ``munged`` of its
own on a private socket, every file under one temporary directory. Jobs run as an unprivileged user.

proctrack/cgroup and task/cgroup with ``ConstrainRAMSpace``: a job's ``--mem`` is a real memory cgroup
limit (cgroup v1 or v2, whichever this machine mounts). The nodes claim 64 CPUs and 8 GPUs each
(``SlurmdParameters=config_overrides``, GPUs without device files) so that the deploy example's own
``#SBATCH`` lines are accepted unchanged. The scheduler looks at pending jobs every 2 s (Slurm's default
is 60 s: a requeued job, held for the credential's lifetime, would wait up to a minute more to start).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

USER = "oomguard-slurm"  # the unprivileged user the jobs run as (made with useradd when missing)
NODES = ("n1", "n2")
NODE_MEMORY_MB = 6000
DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why Slurm cannot run here, or None."""
    absent = [name for name in (*DAEMONS, "sbatch", "scontrol") if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (Debian: apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "the Slurm daemons need root (slurmd runs jobs as their user)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no cgroup filesystem for Slurm's proctrack/cgroup"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_user() -> pwd.struct_passwd:
    """The unprivileged user, made once (no home, no login shell needed: jobs only run commands)."""
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", USER], check=True)
        return pwd.getpwnam(USER)


def cgroup_version() -> int:
    return 2 if Path("/sys/fs/cgroup/cgroup.controllers").exists() else 1


def v2_missing() -> str | None:
    """Why Slurm's cgroup/v2 cannot run on this machine, or None (the unified hierarchy is the one mounted
    at /sys/fs/cgroup, with the memory controller: support_slurm then configures cgroup/v2)."""
    if cgroup_version() == 2:
        return None
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if line.split()[2] == "cgroup2"]
    if not mounts:
        return "this machine mounts cgroup v1 only (no cgroup2 hierarchy at all): Slurm's cgroup/v2 needs one"
    controllers = (Path(mounts[0]) / "cgroup.controllers").read_text().split()
    if "memory" in controllers:
        return (f"the memory controller is on a cgroup v2 mount at {mounts[0]}, not at /sys/fs/cgroup, where "
                "Slurm's cgroup/v2 (CgroupMountpoint) is configured here: not tried")
    return (f"this machine's cgroups are v1, with a cgroup v2 mount at {mounts[0]} whose controllers are "
            f"[{' '.join(controllers)}]: the memory controller is bound to the v1 hierarchy (/sys/fs/cgroup/memory), "
            "which this machine's own processes use, and a controller is in one hierarchy at a time, so Slurm's "
            "cgroup/v2 could not enforce a job's --mem; it needs a host whose cgroups are mounted v2 only")


@dataclass
class Cluster:
    """The daemons' files under ``root``; ``env`` is what a Slurm client needs (SLURM_CONF)."""

    root: Path
    user: pwd.struct_passwd
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    granted: list[Path] = field(default_factory=list)  # directories the job user was let through (ACL)

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def client(self, *argv: str, user: bool = False, env: Mapping[str, str] | None = None,
               cwd: Path | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A Slurm command (sbatch, scontrol, ...), as the job user with ``user``."""
        full = {**os.environ, **(env or {}), **self.env}
        if user:
            full |= {"HOME": str(self.root / "home"), "USER": USER, "LOGNAME": USER}
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=full, cwd=cwd,
                              user=self.user.pw_uid if user else None, group=self.user.pw_gid if user else None,
                              extra_groups=[] if user else None)

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """The daemons' logs' tails, for a failing assertion's message."""
        return "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in ("slurmctld", *NODES))


def write_config(root: Path, user: pwd.struct_passwd) -> None:
    etc, state = root / "etc", root / "state"
    spools = [root / f"spool-{n}" for n in NODES]
    for d in (etc, state, root / "log", root / "run", root / "munge-key", root / "home", *spools):
        d.mkdir(parents=True, exist_ok=True)
    os.chown(root / "home", user.pw_uid, user.pw_gid)
    (root / "munge-key").chmod(0o700)
    key = root / "munge-key" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    ports = {name: free_port() for name in ("ctld", *NODES)}
    nodes = "\n".join(f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={ports[n]} "
                      f"CPUs=64 RealMemory={NODE_MEMORY_MB} Gres=gpu:8 State=UNKNOWN" for n in NODES)
    (etc / "slurm.conf").write_text(f"""\
ClusterName=oomguardtest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ports["ctld"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/run/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={state}
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu
MpiDefault=none
JobRequeue=1
KillWait=10
MinJobAge=300
SlurmdTimeout=30
InactiveLimit=0
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
    (etc / "cgroup.conf").write_text(f"""\
CgroupPlugin=cgroup/v{cgroup_version()}
CgroupMountpoint=/sys/fs/cgroup
CgroupAutomount=no
ConstrainRAMSpace=yes
ConstrainSwapSpace=no
ConstrainCores=no
""")
    (etc / "gres.conf").write_text("AutoDetect=off\nName=gpu File=/dev/loop[0-7]\n")
    root.chmod(0o755)  # the job user reaches the munge socket and the configuration


def let_through(user: pwd.struct_passwd, paths: list[Path]) -> list[Path]:
    """Let the job user pass (x, not read) each directory above ``paths`` that others cannot pass: a
    Python under /root (pyenv) is run by the jobs. Only directories without an ACL of their own are
    given one, so that ``setfacl -b`` restores each exactly (``let_back``)."""
    done: list[Path] = []
    for path in paths:
        for parent in reversed(path.resolve().parents):
            mode = parent.stat()
            if mode.st_mode & 0o001 or mode.st_uid == user.pw_uid or parent in done:
                continue
            if shutil.which("setfacl") is None:
                let_back(done)
                raise RuntimeError(f"the job user cannot reach {path} ({parent} is closed) and there is no "
                                   "setfacl to let it through (Debian: apt-get install acl)")
            acl = subprocess.run(["getfacl", "-c", "--skip-base", str(parent)], capture_output=True, text=True)
            if acl.stdout.strip():
                let_back(done)
                raise RuntimeError(f"the job user cannot reach {path}: {parent} is closed and has an ACL")
            subprocess.run(["setfacl", "-m", f"u:{user.pw_uid}:x", str(parent)], check=True)
            done.append(parent)
    return done


def let_back(dirs: list[Path]) -> None:
    for parent in dirs:
        subprocess.run(["setfacl", "-b", str(parent)], check=False)


def start(root: Path, reach: list[Path]) -> Cluster:
    """Write the configuration and start munged, slurmctld and the two slurmd; wait until both
    nodes are idle; the job user may reach ``reach`` (the Python and the code the jobs run).
    Raises RuntimeError (with the logs) when they do not come up."""
    user = job_user()
    write_config(root, user)
    cluster = Cluster(root, user, granted=let_through(user, reach))
    env = {**os.environ, **cluster.env}
    run = root / "run"
    cluster.procs.append(subprocess.Popen(
        ["munged", "-F", "-f", f"--socket={run}/munge.sock", f"--key-file={root}/munge-key/munge.key",
         f"--pid-file={run}/munged.pid", f"--log-file={root}/log/munged.log", f"--seed-file={run}/munged.seed"],
        stdout=subprocess.DEVNULL, stderr=open(root / "log" / "munged.out", "wb"), start_new_session=True))
    _wait_for(lambda: (run / "munge.sock").exists(), 10, "munged's socket", cluster)
    cluster.procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(cluster.conf)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    for node in NODES:
        cluster.procs.append(subprocess.Popen(["slurmd", "-D", "-N", node, "-f", str(cluster.conf)], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                              start_new_session=True))
    _wait_for(lambda: _idle(cluster), 60, "both nodes idle", cluster)
    return cluster


def _idle(cluster: Cluster) -> bool:
    out = cluster.client("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    return out.returncode == 0 and all(states.get(n) == "idle" for n in NODES)


def _wait_for(ready: object, seconds: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if callable(ready) and ready():
            return
        if any(p.poll() is not None for p in cluster.procs):
            break
        time.sleep(0.5)
    stop(cluster)
    raise RuntimeError(f"Slurm did not come up ({what}):\n{cluster.logs()}")


def stop(cluster: Cluster) -> None:
    """End the daemons (slurmd first: they end their jobs' steps), each waited for: no orphans."""
    for proc in reversed(cluster.procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    let_back(cluster.granted)
    for top in Path("/sys/fs/cgroup").glob("*/slurm_n*"):  # the daemons' own, empty once their jobs ended
        for path in sorted(top.rglob("*"), key=lambda p: -len(p.parts)):
            if path.is_dir():
                with contextlib.suppress(OSError):
                    path.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
