"""Several nodes, one decision: every node's oomguard shares each round through a c10d TCPStore.

Node 0's oomguard hosts a ``torch.distributed.TCPStore`` on the rendezvous port + 1 (the
rendezvous itself is torchrun's: c10d on ``--rdzv-endpoint``); every other node's oomguard is a
client of it. Which node is node 0: the one given ``--node-rank 0``; without node ranks (PyTorch's
own multi-node form), the node c10d's rendezvous would pick to host its store: one whose machine
is the endpoint's host, and of several nodes on that machine the first to bind the port. The
others join it and are numbered 1, 2, ... in the order they joined. A round (one attempt on every
node) goes:

1. node 0 publishes the round's start: the plan (micro-batch, accumulation, allocator setting,
   fallbacks) and the checkpoint to resume from; every other node waits for it and adopts it;
2. each node runs its torchrun; when it ends, the node posts how (kind, evidence). A node that
   sees another node's failure posted stops its own ranks: they would only wait in a collective;
3. every node reads all the posts and picks the same root cause (``choose``: a memory failure
   beats a hang, a crash, a kill, and a node stopped for a peer comes last);
4. node 0 runs the policy on that failure and publishes the decision; the others adopt it.

A node that cannot reach node 0's store, or a round whose post from some node does not come
within ``--peer-timeout``, ends with one line and exit code 75 (EX_TEMPFAIL): a scheduler may
requeue it. Stdlib only at import: torch is imported when a multi-node run starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from oomguard.supervisor.distributed.torchrun import Shape

# EX_TEMPFAIL: the run can go on once every node is back (lifecycle/states.py holds every exit status)
from oomguard.supervisor.lifecycle.states import EXIT_PEER_LOST as EXIT_PEER_LOST

_TIERS = {"cuda_oom": 0, "host_oom": 0, "memory_limit": 0, "hang": 1, "crash": 2, "killed": 3}


class PeerLost(RuntimeError):
    """Another node (or node 0's store) is gone or unreachable; the message is the one line shown."""


def hosts_rendezvous(host: str) -> bool:
    """Is ``host`` this machine? c10d's own test (its name, its addresses, loopback), so oomguard's
    choice of node 0 is the node torchrun's c10d rendezvous picks to host its store. A private
    function of torch's, on purpose: the same answer as c10d's, not a copy that may drift from it."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def store_address(shape: Shape) -> tuple[str, int]:
    """Node 0's oomguard store: the rendezvous host, the rendezvous port + 1."""
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


@dataclass
class Coordinator:
    """This node's side of the shared rounds."""

    shape: Shape
    peer_timeout: float
    store: Any = None
    node: int | None = None  # this node's number in the rounds: --node-rank, or given when it joins

    def __post_init__(self) -> None:
        if self.node is None:
            self.node = self.shape.node_rank

    @property
    def leader(self) -> bool:
        return self.node == 0

    def connect(self) -> None:
        """Host the store (node 0) or reach it (the others) within --peer-timeout; without node
        ranks, first settle which node this is."""
        if self.shape.node_rank is None:
            self._elect()
            return
        self.store = self._open(self.leader)

    def _elect(self) -> None:
        """As c10d does: host the store if the endpoint names this machine and the port is free,
        else join the node that does and take the next number."""
        host, _ = store_address(self.shape)
        if hosts_rendezvous(host):
            try:
                self.store, self.node = self._open(True, quiet=True), 0
                return
            except PeerLost:
                pass  # another node on this machine was first: join it
        self.store = self._open(False)
        self.node = int(self.store.add("oomguard/joined", 1))
        if self.node >= self.shape.nnodes:
            raise PeerLost(f"{self.node + 1} nodes joined oomguard's store, more than --nnodes {self.shape.nnodes}; "
                           "is another run using the same --rdzv-endpoint?")

    def _open(self, master: bool, quiet: bool = False) -> Any:
        from torch.distributed import TCPStore  # only multi-node runs pay for importing torch

        host, port = store_address(self.shape)
        try:
            return TCPStore(host, port, is_master=master, timeout=timedelta(seconds=self.peer_timeout),
                            wait_for_workers=False)
        except (RuntimeError, ValueError, TimeoutError) as exc:
            if quiet:
                raise PeerLost(_first_line(exc)) from None
            what = f"host oomguard's store on port {port}" if master else \
                f"reach node 0's oomguard at {host}:{port} within {self.peer_timeout:g} s"
            me = "this node" if self.node is None else f"node {self.node}"
            raise PeerLost(f"{me} cannot {what} ({_first_line(exc)}); is node 0 "
                           "started with the same --rdzv-endpoint, and the port open?") from None

    def start_round(self, round_: int, proposal: dict[str, Any]) -> dict[str, Any]:
        """Node 0's plan and checkpoint for this round; node 0 publishes its own proposal."""
        key = f"round/{round_}/start"
        if self.leader:
            self._set(key, proposal)
            return proposal
        return self._get(key, f"node 0's plan for round {round_}")

    def report_end(self, round_: int, report: dict[str, Any]) -> None:
        self._set(f"round/{round_}/end/{self.node}", report)

    def peer_failed(self, round_: int) -> int | None:
        """Another node that posted a failure in this round (a quick check; no waiting)."""
        for node in range(self.shape.nnodes):
            key = f"round/{round_}/end/{node}"
            if node != self.node and self._check(key) and self._get(key, "a peer's report").get("kind"):
                return node
        return None

    def ends(self, round_: int) -> dict[int, dict[str, Any]]:
        """Every node's post for this round, waiting up to --peer-timeout for the late ones."""
        return {node: self._get(f"round/{round_}/end/{node}", f"report from node {node} on round {round_}")
                for node in range(self.shape.nnodes)}

    def decision(self, round_: int, mine: dict[str, Any]) -> dict[str, Any]:
        """Node 0's decision after this round; node 0 publishes its own."""
        key = f"round/{round_}/decision"
        if self.leader:
            self._set(key, mine)
            return mine
        return self._get(key, f"node 0's decision after round {round_}")

    def finish(self) -> None:
        """The last word: the others say goodbye; node 0 keeps its store up until they have (bounded),
        so no node loses the store while it still reads the last round."""
        try:
            if not self.leader:
                self.store.set(f"bye/{self.node}", "1")
                return
            self.store.set_timeout(timedelta(seconds=min(self.peer_timeout, 30.0)))
            self.store.wait([f"bye/{node}" for node in range(1, self.shape.nnodes)])
        except (RuntimeError, ValueError, TimeoutError):
            pass  # a node already gone needs no goodbye

    # --- the store, with every failure turned into one line ---

    def _set(self, key: str, value: dict[str, Any]) -> None:
        try:
            self.store.set(key, json.dumps(value))
        except (RuntimeError, ValueError) as exc:
            raise PeerLost(f"lost node 0's oomguard while writing {key} ({_first_line(exc)})") from None

    def _get(self, key: str, what: str) -> dict[str, Any]:
        try:
            raw = self.store.get(key)
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise PeerLost(f"node {self.node}: no {what} within {self.peer_timeout:g} s "
                           f"({_first_line(exc)}); that node or its oomguard is gone") from None
        data: dict[str, Any] = json.loads(raw)
        return data

    def _check(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except (RuntimeError, ValueError) as exc:
            raise PeerLost(f"lost node 0's oomguard ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
