"""Several nodes, one decision: every node's oomguard shares each round through a c10d TCPStore.

Tested in tests/unit/supervisor/distributed/test_coordination.py, test_torchrun.py and
tests/e2e/test_multinode.py.

The store lives on the rendezvous port + 1, hosted by ``--node-rank 0`` or, without node ranks, by
the node c10d would pick to host its own store (on the endpoint's host, first to bind the port);
the others join it in order. Each node beats once a second from a thread of its own; one not heard
for ``SILENT`` seconds is lost. A round: the host gathers the members (every node of a fixed
``--nnodes``; MIN to MAX of an elastic ``--nnodes MIN:MAX``) and publishes them with the plan and
the checkpoint; each member runs its torchrun and posts how it ended (a node that sees another's
failure stops its own ranks, which would only wait in a collective); every node picks the same root
cause (``choose``); the host decides and publishes, the others adopt. A member lost ends the round:
with a fixed ``--nnodes`` with exit 75 (EX_TEMPFAIL, so a scheduler may requeue the set), with an
elastic one as a regroup. The host's loss takes the store with it: the nodes left take it over as
the first time and go on from what each holds. torch is imported only when a multi-node run starts.

The plan for another world (``for_world``, ``adopt``; pure) keeps the global batch asked: the
accumulation becomes accumulation × old world ÷ new world at the same micro-batch, re-split to the
largest divisor below it where it does not divide (never above: a larger one was never shown to
fit); where the new world does not divide the global batch no exact plan exists, and that is said.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, NamedTuple

from oomguard.common.batch import BatchPlan, largest_divisor_at_most
from oomguard.supervisor.decide.policy import Plan
from oomguard.supervisor.distributed.torchrun import Shape

# EX_TEMPFAIL: the run can go on once every node is back (lifecycle.py holds every exit status)
from oomguard.supervisor.lifecycle import EXIT_PEER_LOST as EXIT_PEER_LOST

BEAT = 1.0  # seconds between a node's heartbeats in the store
SILENT = 10.0  # a node whose oomguard has not beaten for this long is lost
POLL = 0.2  # seconds between looks at the store while waiting for another node
_TIERS = {"cuda_oom": 0, "host_oom": 0, "memory_limit": 0, "hang": 1, "crash": 2, "killed": 3}
_STORE_ERRORS = (RuntimeError, ValueError, TimeoutError)  # a TCPStore's (DistNetworkError is a RuntimeError)


class PeerLost(RuntimeError):
    """Another node (or the store's host) is gone or unreachable; the message is the one line shown."""


def _torch_quietly() -> None:
    """Import torch with its C++ warnings off (a dead store's host logs C++ frames per failed call;
    oomguard says the one line that matters), then put the setting back for the ranks to inherit."""
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = before or "ERROR"
    try:
        import torch.distributed  # noqa: F401  (the setting is read when torch's C++ library loads)
    finally:
        if before is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]


def store_address(shape: Shape) -> tuple[str, int]:
    """oomguard's store: the rendezvous host, the rendezvous port + 1."""
    assert shape.rdzv_endpoint is not None
    host, _, port = shape.rdzv_endpoint.rpartition(":")
    return host, int(port) + 1


def choose(reports: dict[int, dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    """The node whose failure decides the round, the same on every node; None when all succeeded."""
    def blame(item: tuple[int, dict[str, Any]]) -> tuple[int, int]:
        node, report = item
        return (4 if report.get("stopped_for_peer") else _TIERS.get(str(report["kind"]), 2)), node

    return min(((node, r) for node, r in reports.items() if r.get("kind")), key=blame, default=None)


def for_world(plan: Plan, world: int) -> Plan | str:
    """``plan`` at ``world`` ranks with the same global batch; the one line saying why not, where no
    exact plan exists."""
    b = plan.batch
    if world == b.world_size:
        return plan
    if not b.accumulates:
        return (f"the command passes no {{grad_accum}}, so the global batch {b.asked} cannot be kept at "
                f"world {world}")
    if b.global_batch % world:
        return f"global batch {b.global_batch} is not divisible by world {world}"
    micro = largest_divisor_at_most(b.global_batch // world, b.micro_batch)
    assert micro is not None  # 1 divides every per-rank batch
    return replace(plan, batch=BatchPlan(micro, b.global_batch, world))


def adopt(plan: Plan, agreed: Mapping[str, Any]) -> Plan | None:
    """The round's shared plan (``Plan.as_dict``) as this node's, whatever world it is for; None when
    it is not for the global batch this node was asked (another job on the same store)."""
    resumed = plan.resumed(agreed)
    if resumed is not None or agreed.get("world_size") == plan.batch.world_size:
        return resumed
    if (agreed.get("asked_global") or agreed.get("global_batch")) != plan.batch.asked:
        return None
    try:
        batch = BatchPlan(int(agreed["micro_batch"]), int(agreed["global_batch"]), int(agreed["world_size"]),
                          agreed.get("asked_global"))
    except (KeyError, TypeError, ValueError):
        return None
    return Plan(batch, bool(agreed.get("expandable_segments")), int(agreed.get("fallbacks_applied") or 0),
                agreed.get("eval_micro_batch", plan.eval_micro_batch), agreed.get("num_workers", plan.num_workers))


class News(NamedTuple):
    """What ends this node's attempt early, seen during a round."""

    regroup: bool  # the round ends for the nodes to regroup (an elastic run): no failure
    node: int | None  # the node it is about, where one is
    why: str


@dataclass
class Coordinator:
    """This node's side of the shared rounds."""

    shape: Shape
    peer_timeout: float
    store: Any = None
    node: int | None = None  # this node's number in the rounds: --node-rank, or given when it joins
    hosting: bool = False  # this node's oomguard hosts the store (and so decides for every node)
    host: int | None = 0  # the node that hosts the store, as far as this node knows
    round: int = 0  # the last round this node saw started
    members: tuple[int, ...] = ()  # the nodes of that round
    say: Callable[[str], None] = lambda line: None  # a line for the log (a store taken over)
    stopping: Callable[[], bool] = lambda: False  # the user's stop (a signal): no more waiting for a round
    _posted: dict[str, Any] | None = field(default=None, repr=False)  # this node's post for the round
    _heard: dict[int, tuple[int, float]] = field(default_factory=dict, repr=False)  # beat count, when seen
    _top: int = field(default=0, repr=False)  # the highest node number handed out in this store
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the beat thread's and ours
    _closed: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        if self.node is None:
            self.node = self.shape.node_rank

    @property
    def leader(self) -> bool:
        return self.hosting

    @property
    def me(self) -> int:
        assert self.node is not None, "connect() first"
        return self.node

    def connect(self) -> None:
        """Host the store (node 0) or reach it (the others) within --peer-timeout; without node
        ranks, first settle which node this is. Then beat, from now on."""
        if self.shape.node_rank is None:
            self._elect()
        else:
            self.hosting = self.node == 0
            self.store = self._open(self.hosting)
        self._op("add", f"beat/{self.me}", 1)  # heard at once, not a beat later
        threading.Thread(target=self._beat, name="oomguard-beat", daemon=True).start()

    def _elect(self) -> None:
        """As c10d does: host the store if the endpoint names this machine and the port is free,
        else join the node that does and take the next number."""
        if (store := self._host_here()) is not None:
            self.store, self.node = store, 0
            return
        self.store = self._open(False)
        self.node = int(self.store.add("oomguard/joined", 1))
        if self.node >= self.shape.nnodes and not self.shape.elastic:  # an elastic run's node may come back
            raise PeerLost(f"{self.node + 1} nodes joined oomguard's store, more than --nnodes {self.shape.nnodes}; "
                           "is another run using the same --rdzv-endpoint?")

    def _open(self, master: bool, quiet: bool = False, timeout: float | None = None) -> Any:
        _torch_quietly()  # only multi-node runs pay for importing torch
        from torch.distributed import TCPStore

        host, port = store_address(self.shape)
        wait = timedelta(seconds=self.peer_timeout if timeout is None else timeout)
        try:
            return TCPStore(host, port, is_master=master, timeout=wait, wait_for_workers=False)
        except _STORE_ERRORS as exc:
            if quiet:
                raise PeerLost(_first_line(exc)) from None
            what = f"host oomguard's store on port {port}" if master else \
                f"reach node 0's oomguard at {host}:{port} within {self.peer_timeout:g} s"
            me = "this node" if self.node is None else f"node {self.node}"
            raise PeerLost(f"{me} cannot {what} ({_first_line(exc)}); is node 0 "
                           "started with the same --rdzv-endpoint, and the port open?") from None

    def _beat(self) -> None:
        while not self._closed.wait(BEAT):
            try:
                self._op("add", f"beat/{self.node}", 1)
            except _STORE_ERRORS:
                pass  # the store is gone: the loop sees it at its next look and takes the store over

    # --- the rounds ---

    def gather(self) -> tuple[int, ...]:
        """The host: the next round's members. The first round waits up to --peer-timeout for every node;
        later ones go on at once with enough nodes heard (all of a fixed --nnodes, MIN of an elastic one)."""
        least = self.shape.min_nodes or self.shape.nnodes
        first, deadline = self.round == 0, time.monotonic() + self.peer_timeout
        while True:
            heard = [n for n in self._known() if n == self.me or self._alive(n)]
            chosen = sorted(sorted(heard, key=lambda n: (n not in self.members, n))[:self.shape.nnodes])
            late = time.monotonic() >= deadline
            if len(chosen) == self.shape.nnodes or (len(chosen) >= least and (late or not first)):
                return tuple(chosen)
            if late:
                host, port = store_address(self.shape)
                need = f"MIN {least} of --nnodes {least}:{self.shape.nnodes}" if self.shape.elastic \
                    else f"--nnodes {self.shape.nnodes}"
                raise PeerLost(f"only {len(chosen)} node(s) heard within {self.peer_timeout:g} s, fewer than {need}; "
                               f"the others' oomguards are not running or cannot reach {host}:{port}")
            time.sleep(POLL)

    def start_round(self, proposal: dict[str, Any]) -> dict[str, Any]:
        """The host publishes the next round (``proposal``: its members, from ``gather``); every member
        adopts it, others wait for a round that takes them in. A ``stop`` ends the run (exit 75)."""
        while not self.hosting:
            agreed = self._wait_start()
            if agreed is not None:
                return agreed
        r = self.round + 1
        agreed = {**proposal, "round": r, "host": self.me}
        self._call("set", f"round/{r}/start", json.dumps(agreed))
        self._call("set", "oomguard/round", str(r))  # after the start: whoever reads r finds its start
        self._enter(agreed)
        return agreed

    def _wait_start(self) -> dict[str, Any] | None:
        """A non-host's wait for the next round that takes it in (a member up to --peer-timeout: the host is
        due to publish); None when this node took the store over from a lost host meanwhile."""
        member, deadline = bool(self.members), time.monotonic() + self.peer_timeout
        while not self.hosting:
            r = int(self._read("oomguard/round") or 0)
            if r > self.round:
                agreed: dict[str, Any] = json.loads(self._call("get", f"round/{r}/start"))
                self.round = r
                if "stop" in agreed:
                    raise PeerLost(str(agreed["stop"]))
                if self.me in agreed["members"]:
                    self._enter(agreed)
                    return agreed
                self.members, member = (), False  # not in this one: the host takes it in at a later one
            if member and time.monotonic() > deadline:
                raise PeerLost(f"node {self.me}: no plan for round {self.round + 1} from node {self.host} within "
                               f"{self.peer_timeout:g} s; that node or its oomguard is gone")
            if self.stopping():
                raise PeerLost(f"node {self.me}: stopped by a signal while waiting for round {self.round + 1}")
            time.sleep(POLL)
        return None

    def _enter(self, agreed: dict[str, Any]) -> None:
        self.round, self.host = int(agreed["round"]), int(agreed["host"])
        self.members, self._posted = tuple(int(n) for n in agreed["members"]), None

    def report_end(self, report: dict[str, Any]) -> None:
        self._posted = report
        self._call("set", f"round/{self.round}/end/{self.me}", json.dumps(report))

    def news(self) -> News | None:
        """Why this node's ranks must stop now (a quick look): a regroup (a member lost, a node back),
        another member's attempt failed, or a member of a fixed --nnodes is lost."""
        r = self.round
        if (why := self.regrouped()) is not None:
            return News(True, None, why)
        for node in self.members:
            if node == self.me:
                continue
            if (report := self._read(f"round/{r}/end/{node}")) is not None:
                if report.get("kind"):
                    return News(False, node, f"node {node} failed in round {r}")
            elif not self._alive(node):
                why = _lost((node,))
                return News(True, node, self.regroup(why)) if self.shape.elastic else News(False, node, why)
        return None

    def regroup(self, why: str) -> str:
        """End this round for the nodes to regroup; the first node to say why is the one kept."""
        return str(json.loads(self._call("compare_set", f"round/{self.round}/regroup", "", json.dumps(why))))

    def regrouped(self) -> str | None:
        """Why this round ended for the nodes to regroup, where it did."""
        why = self._read(f"round/{self.round}/regroup")
        return None if why is None else str(why)

    def newcomers(self) -> list[int]:
        """The host of an elastic run short of nodes: the nodes heard that are not in this round."""
        if not self.shape.elastic or len(self.members) >= self.shape.nnodes:
            return []
        return [n for n in self._known() if n not in self.members and n != self.me and self._alive(n)]

    def ends(self) -> tuple[dict[int, dict[str, Any]], tuple[int, ...]]:
        """Every member's post for this round and the members lost before posting (an elastic run:
        the round is then a regroup); a fixed --nnodes run ends on a lost node (exit 75)."""
        r, reports, start = self.round, {}, time.monotonic()
        while True:
            key = f"round/{r}/end/{self.me}"
            if self._posted is not None and not self._call("check", [key]):  # a store taken over is empty
                self._call("set", key, json.dumps(self._posted))
            for node in self.members:
                if node not in reports and (report := self._read(f"round/{r}/end/{node}")) is not None:
                    reports[node] = report
            missing = [n for n in self.members if n not in reports]
            lost = tuple(n for n in missing if not self._alive(n))
            if lost and not self.shape.elastic:
                raise PeerLost(f"node {self.me}: no report from node {lost[0]} on round {r}: its oomguard has not "
                               f"been heard for {SILENT:g} s; that node or its oomguard is gone")
            if len(lost) == len(missing):
                if lost:
                    self.regroup(_lost(lost))
                return reports, lost
            if time.monotonic() - start > self.peer_timeout:
                raise PeerLost(f"node {self.me}: no report from node {missing[0]} on round {r} within "
                               f"{self.peer_timeout:g} s; that node or its oomguard is gone")
            time.sleep(POLL)

    def decision(self, mine: dict[str, Any]) -> dict[str, Any]:
        """The host's decision after this round; the host publishes its own (a node that took the
        store over decides as its host did: it saw the same posts)."""
        key, deadline = f"round/{self.round}/decision", time.monotonic() + self.peer_timeout
        while True:
            if self.hosting:
                return dict(json.loads(self._call("compare_set", key, "", json.dumps(mine))))
            if (decided := self._read(key)) is not None:
                return dict(decided)
            if time.monotonic() > deadline:
                raise PeerLost(f"node {self.me}: no decision after round {self.round} from node {self.host} within "
                               f"{self.peer_timeout:g} s; that node or its oomguard is gone")
            time.sleep(POLL)

    def finish(self) -> None:
        """The last word: the others say goodbye; the host keeps its store up until the members of the
        last round have (bounded), so no node loses the store while it still reads the last round."""
        try:
            if not self.hosting:
                self._op("set", f"bye/{self.me}", "1")
                return
            deadline = time.monotonic() + min(self.peer_timeout, 30.0)
            waiting = [n for n in self.members if n != self.me]
            while waiting and time.monotonic() < deadline:
                waiting = [n for n in waiting if not self._op("check", [f"bye/{n}"]) and self._alive(n)]
                time.sleep(POLL)
        except (*_STORE_ERRORS, PeerLost):
            pass  # a node already gone needs no goodbye
        finally:
            self._closed.set()

    # --- liveness and the store, with the store taken over when its host is gone ---

    def _known(self) -> range:
        """Every node number handed out so far in this store (a fixed-rank run's are 0..nnodes-1)."""
        self._top = max(self._top, int(self._call("add", "oomguard/joined", 0)))
        return range(max(self.shape.nnodes, self._top + 1))

    def _alive(self, node: int) -> bool:
        """Has ``node``'s oomguard beaten within SILENT seconds (as this node has watched its count)?"""
        value, now = int(self._call("add", f"beat/{node}", 0)), time.monotonic()
        seen = self._heard.get(node)
        if seen is None and value == 0:
            return False  # never beat in this store
        if seen is None or value != seen[0]:
            self._heard[node] = (value, now)
            return True
        return now - seen[1] < SILENT

    def _read(self, key: str) -> Any:
        """The JSON value at ``key``, or None where there is none yet."""
        return json.loads(self._call("get", key)) if self._call("check", [key]) else None

    def _op(self, op: str, *args: Any) -> Any:
        with self._lock:  # the beat thread shares the connection
            return getattr(self.store, op)(*args)

    def _call(self, op: str, *args: Any) -> Any:
        """One store operation; where the store's host is gone, the store is taken over first."""
        try:
            return self._op(op, *args)
        except _STORE_ERRORS as exc:
            self._take_over(exc)
        try:
            return self._op(op, *args)
        except _STORE_ERRORS as exc:
            raise PeerLost(f"node {self.me}: oomguard's store failed again after it was taken over "
                           f"({_first_line(exc)})") from None

    def _take_over(self, exc: BaseException) -> None:
        """The store's host is gone: host the store here as the first time (a node on the endpoint's
        host binds the port first) or join the node that does, within SILENT seconds."""
        lost, (host, port) = self.host, store_address(self.shape)
        if self.hosting or not self.shape.elastic:
            raise PeerLost(f"lost node {lost}'s oomguard, which keeps the shared decision ({_first_line(exc)})")
        deadline = time.monotonic() + SILENT
        while (store := self._reopen()) is None:
            if time.monotonic() > deadline:
                raise PeerLost(f"node {lost}'s oomguard kept the shared decision and is gone, and no node took "
                               f"it over on {host}:{port} within {SILENT:g} s (only a node on {host}, the "
                               "rendezvous host, can: torchrun's c10d rendezvous needs that machine too)")
            time.sleep(POLL)
        with self._lock:
            self.store = store
        now = time.monotonic()
        self._heard = {n: (0, now) for n in self.members}  # the members have SILENT s to reach the new store
        if lost is not None:
            self._heard[lost] = (0, float("-inf"))
        self.host = self.me if self.hosting else None
        if self.hosting:
            self._op("add", "oomguard/joined", max(self._top, self.me, *self.members))
        self._op("add", f"beat/{self.me}", 1)
        self.say(f"node {lost}'s oomguard is gone with oomguard's store; " + (
            f"this node keeps it now on port {port}" if self.hosting else f"joined the node that keeps it now at "
            f"{host}:{port}"))

    def _host_here(self) -> Any:
        """The store bound here where the endpoint names this machine and its port is free (as c10d
        picks its store's host), else None."""
        # Is the endpoint's host this machine? c10d's own (private) test on purpose, so that oomguard's
        # store's host is the node c10d picks to host its store, not a copy of its test that may drift.
        _torch_quietly()
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

        if _matches_machine_hostname(store_address(self.shape)[0]):
            try:
                store = self._open(True, quiet=True)
                self.hosting = True
                return store
            except PeerLost:
                pass  # another node on this machine was first: join it
        return None

    def _reopen(self) -> Any:
        if (store := self._host_here()) is not None:
            return store
        try:
            return self._open(False, quiet=True, timeout=2.0)
        except PeerLost:
            return None


def _lost(nodes: tuple[int, ...]) -> str:
    return f"node {', '.join(map(str, nodes))} lost: its oomguard has not been heard for {SILENT:g} s"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
