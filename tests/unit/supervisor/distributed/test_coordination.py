"""The shared rounds of an elastic run (``dist.coordination``) on real TCPStores on this machine:
a member that stops beating is lost and the round becomes a regroup, a node back is a newcomer, and
the store's host killed outright is taken over by the node left, which goes on from what it holds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from oomguard.supervisor.distributed import coordination
from oomguard.supervisor.distributed.coordination import Coordinator
from oomguard.supervisor.distributed.torchrun import Shape

ROOT = Path(__file__).resolve().parents[4]


def free_port() -> int:
    """A rendezvous port whose successor (oomguard's store) is free."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1]) - 1


def test_a_silent_member_ends_the_round_as_a_regroup_and_a_node_back_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordination, "SILENT", 1.0)
    shape = Shape(1, 2, None, f"localhost:{free_port()}", 1)
    host, other = Coordinator(shape, 5.0), Coordinator(shape, 5.0)
    host.connect()
    other.connect()
    members = host.gather()
    assert members == (0, 1)
    host.start_round({"members": list(members)})
    assert other.start_round({})["members"] == [0, 1] and other.round == 1
    assert host.news() is None
    other._closed.set()  # its oomguard is gone: no more beats
    time.sleep(1.5)
    news = host.news()
    assert news is not None and news.regroup and news.node == 1
    assert news.why == "node 1 lost: its oomguard has not been heard for 1 s" == host.regrouped()
    assert host.regroup("another reason") == news.why  # the first to say why is the one kept
    host.report_end({"kind": "crash"})
    assert host.ends() == ({0: {"kind": "crash"}}, (1,))
    assert host.gather() == (0,)  # the next round: the node left
    host.start_round({"members": [0]})
    back = Coordinator(shape, 5.0)
    back.connect()  # a node started again joins with the next number
    assert back.node == 2 and host.newcomers() == [2]
    host.finish()


HOST = """
import time
from oomguard.supervisor.distributed.coordination import Coordinator
from oomguard.supervisor.distributed.torchrun import Shape
host = Coordinator(Shape(1, 2, None, "localhost:{port}", 1), 5.0)
host.connect()
print("hosting", flush=True)
host.start_round({{"members": list(host.gather()), "plan": {{"micro_batch": 4}}}})
time.sleep(60)
"""


def test_the_stores_host_killed_outright_is_taken_over_by_the_node_left() -> None:
    port = free_port()
    shape = Shape(1, 2, None, f"localhost:{port}", 1)
    left = Coordinator(shape, 20.0)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOST.format(port=port))], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "hosting\n"  # it bound first: node 0
        left.connect()
        assert left.start_round({})["plan"] == {"micro_batch": 4} and (left.node, left.host) == (1, 0)
        proc.kill()
        proc.wait()
        news = left.news()  # the store is gone: taken over, and its host is lost at once
        assert left.leader and news is not None and news.regroup and news.node == 0
        assert left.gather() == (1,) and left.start_round({"members": [1]})["round"] == 2
    finally:
        proc.kill()
        left.finish()
