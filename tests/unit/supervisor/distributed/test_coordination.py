"""The shared rounds of an elastic run (``dist.coordination``) on real TCPStores on this machine:
a member that stops beating is lost and the round becomes a regroup, a node back is a newcomer, and
the store's host killed outright is taken over by the node left, which goes on from what it holds.
And the plan for another world size (pure): the global batch asked, exactly, or one line saying why
no plan keeps it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.distributed import coordination
from oomguard.supervisor.distributed.coordination import Coordinator, adopt, for_world
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


def test_a_smaller_world_takes_the_accumulation_up_and_the_full_world_brings_it_back() -> None:
    full = Plan(BatchPlan(4, 32, 4), expandable_segments=True, fallbacks_applied=1)
    half = for_world(full, 2)
    assert isinstance(half, Plan)
    assert (half.batch.micro_batch, half.batch.grad_accum, half.batch.world_size) == (4, 4, 2)
    assert half.batch.global_batch == 32 and (half.expandable_segments, half.fallbacks_applied) == (True, 1)
    assert for_world(half, 4) == full  # the node back: the original plan
    assert for_world(full, 4) is full


def test_a_micro_batch_that_does_not_divide_the_new_per_rank_batch_is_split_below_never_above() -> None:
    # 48 over 3 ranks: 16 each at micro 16; over 2: 24 each, which 16 does not divide: 12 × 2; over 4: 12 × 1
    plan = Plan(BatchPlan(16, 48, 3))
    two = for_world(plan, 2)
    assert isinstance(two, Plan) and (two.batch.micro_batch, two.batch.grad_accum) == (12, 2)
    four = for_world(plan, 4)
    assert isinstance(four, Plan) and (four.batch.micro_batch, four.batch.grad_accum) == (12, 1)
    assert all(p.batch.micro_batch * p.batch.grad_accum * p.batch.world_size == 48 for p in (two, four))


def test_where_no_exact_plan_exists_it_says_why_in_one_line() -> None:
    assert for_world(Plan(BatchPlan(4, 16, 2)), 3) == "global batch 16 is not divisible by world 3"
    cannot = Plan(BatchPlan(4, 8, 2, asked_global=8))  # the script takes no accumulation
    assert for_world(cannot, 1) == "the command passes no {grad_accum}, so the global batch 8 cannot be kept at world 1"


def test_every_node_adopts_the_hosts_plan_for_another_world_but_never_another_jobs() -> None:
    mine = Plan(BatchPlan(4, 32, 4), eval_micro_batch=2)
    shared = for_world(mine, 2)
    assert isinstance(shared, Plan)
    assert adopt(mine, shared.as_dict()) == shared
    assert adopt(mine, replace(mine, batch=BatchPlan(2, 32, 4)).as_dict()) == replace(mine, batch=BatchPlan(2, 32, 4))
    assert adopt(mine, Plan(BatchPlan(4, 64, 2)).as_dict()) is None  # another global batch: not this run's
