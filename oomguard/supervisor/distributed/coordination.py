"""Several nodes, one decision: every node's oomguard shares each round through a c10d TCPStore.

Tested in tests/unit/supervisor/distributed/test_torchrun.py, test_coordination.py and
tests/e2e/test_multinode.py.

One node's oomguard hosts a ``torch.distributed.TCPStore`` on the rendezvous port + 1 (the
rendezvous itself is torchrun's: c10d on ``--rdzv-endpoint``); every other node's oomguard is a
client of it. Which node hosts it: the one given ``--node-rank 0``; without node ranks (PyTorch's
own multi-node form), the node c10d's rendezvous would pick to host its store: one whose machine
is the endpoint's host, and of several nodes on that machine the first to bind the port. The
others join it and are numbered 1, 2, ... in the order they joined.

Every node's oomguard beats in the store once a second (a thread of its own, so a busy loop never
misses one); a node not heard for ``SILENT`` seconds is lost. A round (one attempt on the members)
goes:

1. the host gathers the round's members (the nodes heard: every node of a fixed ``--nnodes``; with
   torchrun's elastic ``--nnodes MIN:MAX`` at least MIN, at most MAX) and publishes them with the
   plan for that world and the checkpoint to resume from; every member adopts them. A node that is
   not a member (one that came back while a round ran) waits for the round that takes it in;
2. each member runs its torchrun; when it ends, the node posts how (kind, evidence). A node that
   sees another member's failure posted stops its own ranks: they would only wait in a collective;
3. every node reads all the posts and picks the same root cause (``choose``: a memory failure
   beats a hang, a crash, a kill, and a node stopped for a peer comes last);
4. the host runs the policy on that failure and publishes the decision; the others adopt it.

A member lost during a round ends it on every node: with a fixed ``--nnodes`` with one line and exit
code 75 (EX_TEMPFAIL: a scheduler may requeue the full set); with an elastic one as a regroup (the
round's ``regroup`` key, set once: the first node to see the loss writes why), after which the host
gathers the nodes left. The host's own loss takes its store with it: the nodes left take the store
over as it was taken the first time (a node on the endpoint's host binds the port, the others join
it) and go on from what each of them already holds (the round number, the members, the last plan).
Stdlib only at import: torch is imported when a multi-node run starts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

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
    """Import torch with its C++ warnings off: a store whose host died logs a stack of C++ frames per
    failed call, and oomguard says the one line that matters itself. The setting is put back, so
    the ranks (which inherit oomguard's environment) keep the user's."""
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = before or "ERROR"
    try:
        import torch.distributed  # noqa: F401  (the setting is read when torch's C++ library loads)
    finally:
        if before is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]


def hosts_rendezvous(host: str) -> bool:
    """Is ``host`` this machine? c10d's own test (its name, its addresses, loopback), so oomguard's
    choice of the store's host is the node torchrun's c10d rendezvous picks to host its store. A
    private function of torch's, on purpose: the same answer as c10d's, not a copy that may drift."""
    _torch_quietly()
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def store_address(shape: Shape) -> tuple[str, int]:
    """oomguard's store: the rendezvous host, the rendezvous port + 1."""
    assert shape.rdzv_endpoint is not None
    host, _, port = shape.rdzv_endpoint.rpartition(":")
    return host, int(port) + 1


def choose(reports: dict[int, dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    """The node whose failure decides the round, the same on every node; None when all succeeded."""
    failed = {node: r for node, r in reports.items() if r.get("kind")}
    if not failed:
        return None

    def blame(item: tuple[int, dict[str, Any]]) -> tuple[int, int]:
        node, report = item
        tier = 4 if report.get("stopped_for_peer") else _TIERS.get(str(report["kind"]), 2)
        return tier, node

    return min(failed.items(), key=blame)


class News(NamedTuple):
    """What ends this node's attempt early, seen during a round."""

    regroup: bool  # the round ends for the nodes to regroup (an elastic run): no failure
    node: int | None  # the node it is about, where one is
    why: str


def _quiet(line: str) -> None:
    """The default for ``Coordinator.say``: nothing to tell."""


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
    say: Callable[[str], None] = _quiet  # a line for the log (a store taken over)
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
        host, _ = store_address(self.shape)
        if hosts_rendezvous(host):
            try:
                self.store, self.node, self.hosting = self._open(True, quiet=True), 0, True
                return
            except PeerLost:
                pass  # another node on this machine was first: join it
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
        """The host: the next round's members. At the first round every node is waited for up to
        --peer-timeout; later, the nodes heard go on at once where there are enough of them (every
        node of a fixed --nnodes, MIN of an elastic one), and are waited for up to --peer-timeout where not."""
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
        """The host publishes the next round (``proposal`` names its members, from ``gather``); every
        member adopts it. A node that is not a member waits for the round that takes it in. A
        proposal with ``stop`` ends the run on every node with that line (exit 75)."""
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
        """A non-host's wait for the next round that takes it in; None when the store's host was lost
        meanwhile and this node took the store over. A member of the last round waits up to
        --peer-timeout (the host is due to publish); a node taken in by none waits while the host runs."""
        member, deadline = bool(self.members), time.monotonic() + self.peer_timeout
        while not self.hosting:
            r = int(self._call("get", "oomguard/round")) if self._call("check", ["oomguard/round"]) else 0
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
        """Why this node's ranks must stop now (a quick look, no waiting): the round ends for the nodes
        to regroup (a member lost, a node back), or another member's attempt failed, or a member of a
        fixed --nnodes is lost."""
        r = self.round
        if (why := self.regrouped()) is not None:
            return News(True, None, why)
        for node in self.members:
            key = f"round/{r}/end/{node}"
            if node == self.me:
                continue
            if self._call("check", [key]):
                if json.loads(self._call("get", key)).get("kind"):
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
        key = f"round/{self.round}/regroup"
        return str(json.loads(self._call("get", key))) if self._call("check", [key]) else None

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
                if node not in reports and self._call("check", [f"round/{r}/end/{node}"]):
                    reports[node] = json.loads(self._call("get", f"round/{r}/end/{node}"))
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
                decided: dict[str, Any] = json.loads(self._call("compare_set", key, "", json.dumps(mine)))
                return decided
            if self._call("check", [key]):
                decided = json.loads(self._call("get", key))
                return decided
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
        while (store := self._reopen(host)) is None:
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

    def _reopen(self, host: str) -> Any:
        if hosts_rendezvous(host):
            try:
                store = self._open(True, quiet=True)
                self.hosting = True
                return store
            except PeerLost:
                pass  # another node on this machine was first
        try:
            return self._open(False, quiet=True, timeout=2.0)
        except PeerLost:
            return None


def _lost(nodes: tuple[int, ...]) -> str:
    return f"node {', '.join(map(str, nodes))} lost: its oomguard has not been heard for {SILENT:g} s"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
