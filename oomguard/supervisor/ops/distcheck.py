"""``oomguard doctor`` for runs of several ranks and nodes: the collective backends torch has here
(NCCL for GPUs, Gloo for CPUs), and the rendezvous endpoint every node must reach.

Node 0 needs the rendezvous port (torchrun's c10d store) and the port after it (oomguard's shared
store) free to listen on; every other node needs to reach both. A refused connection before node 0
started is a warning, an unreachable or unresolvable host a failure.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

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
        busy = [p for p in ports if not _free(p)]
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


def _free(port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False


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
