"""oomguard doctor for several ranks and nodes: backends from the real torch here, the rendezvous
against real sockets on 127.0.0.1."""

from __future__ import annotations

import socket

from support import oomguard

from oomguard.supervisor.ops.doctor import backend_lines, rendezvous_lines


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
