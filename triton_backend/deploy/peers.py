"""A router of a router tier among its peers (`poolpipe serve --nodes INV --router NAME`).

Each router asks its peers' readiness checks, as the balancer does (any answer means the
peer runs and drives its shard). When a peer stops answering for long enough
(poolpipe.domain.tier.TierView), the routers left share its nodes out
(Inventory.assignment: the same function of the same inventory on every router, so each
takes its own part and none takes a node twice): each re-plans for its larger shard
through the reshard flow and rolls the plan out by pipeline flush, which loads its
partition models on the nodes it adopts (its claim: their names carry the router's name)
and only then unloads what the peer left there (Deployment.fence: the peer's calls there
fail from now on, and its reload finds the claim, should it still run). When the peer
answers again, the routers that adopted its nodes hand them back the same way (re-plan for
their own shard, roll out: their models leave the nodes) while the peer, starting, waits
for its nodes to be free before it loads anything (its readiness check says so)."""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from poolpipe.domain.inventory import Inventory
from poolpipe.domain.tier import TierView
from poolpipe.errors import PoolpipeError
from triton_backend.deploy.deployment import Deployment, foreign_partitions
from triton_backend.node.triton import NodeError, RemoteNode
from triton_backend.router.readiness import READY_PATH

log = logging.getLogger("poolpipe.serve")

# A peer never seen answering is taken for gone only this long after the router started
# (a tier starts router by router).
START_GRACE_S = 30.0
# A re-shard that failed (its flow's error, a rollout rolled back) is tried again after this.
RESHARD_RETRY_S = 10.0
# How long a router coming back waits for the routers that adopted its nodes to hand them back.
HAND_BACK_TIMEOUT_S = 120.0


def shard_file(workspace: Path, name: str) -> Path:
    """Where router `name` keeps its shard's inventory: what it re-plans for."""
    return Path(workspace) / f"inventory-{name}.toml"


def answers(address: str, timeout_s: float) -> bool:
    """Whether the readiness check at host:port answers at all (ready or not)."""
    try:
        with urllib.request.urlopen(f"http://{address}{READY_PATH}", timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True  # 404 draining, 503 not ready: it runs
    except (OSError, ValueError):
        return False


class TierMember:
    """Router `name` of `inventory`'s tier: waits for its nodes at start-up, then follows
    its peers and re-shards (`on_reshard(router gRPC address, shard inventory file, why)`:
    flows.replan.on_reshard) when the live set changes."""

    def __init__(
        self,
        inventory: Inventory,
        name: str,
        workspace: Path,
        key: str | None,
        adopt_after_s: float,
        on_reshard: Callable[[str, str, str], dict] | None,
    ):
        self.inventory, self.name, self.workspace, self.key = inventory, name, workspace, key
        self.adopt_after_s, self.on_reshard = adopt_after_s, on_reshard
        self.peers = {r.name: r.ready for r in inventory.routers if r.name != name}
        b = inventory.balancer
        self.period_s = b.check_ms / 1e3 if b is not None else 0.5
        self.shard = tuple(n.name for n in inventory.shard(name).nodes)
        self.waiting = ""  # what start-up waits for (its readiness check says it)
        self.reshards: list[dict] = []  # each re-shard: trigger, nodes, the flow's decision

    def peer_answers(self, peer: str) -> bool:
        address = self.peers.get(peer)
        return address is not None and answers(address, min(1.0, self.period_s))

    def wait_for_shard(
        self, models: list[str], stop: threading.Event, timeout_s: float = HAND_BACK_TIMEOUT_S
    ) -> None:
        """Until no live peer holds a node of this router's shard (a peer gone leaves its
        partition models behind: Deployment.up unloads them); PoolpipeError naming the
        holders after `timeout_s`."""
        nodes = [
            RemoteNode.of(g, self.key)
            for n in self.inventory.shard(self.name).nodes
            for g in n.each_gpu()
        ]
        deadline = time.monotonic() + timeout_s
        while True:
            held: dict[str, list[str]] = {}
            for node in nodes:
                try:
                    owners = {o for _, o, _ in foreign_partitions([node], models, self.name)}
                except NodeError:
                    continue  # not answering: attaching names it
                for owner in sorted(owners):
                    if self.peer_answers(owner):
                        held.setdefault(owner, []).append(node.name)
            if not held:
                self.waiting = ""
                return
            self.waiting = "waiting for " + "; ".join(
                f"router {o} to hand back node(s) {', '.join(ns)}" for o, ns in sorted(held.items())
            )
            if time.monotonic() > deadline:
                raise PoolpipeError(
                    f"router {self.name}: after {timeout_s:g} s still {self.waiting}; those "
                    "routers adopted them while this one was gone and hand them back once they "
                    "see it answer: check that they reach its readiness address "
                    f"({self.inventory.router(self.name).ready})"
                )
            if stop.wait(self.period_s):
                raise PoolpipeError(f"router {self.name}: stopped while {self.waiting}")

    def follow(self, deployment: Deployment, lock: threading.Lock, stop: threading.Event) -> None:
        """Ask the peers every check interval; re-shard when the nodes this router should
        drive differ from those it drives (tried again after RESHARD_RETRY_S on failure)."""
        view = TierView(self.name, self.peers, self.adopt_after_s, START_GRACE_S, time.monotonic())
        retry_at = 0.0
        while not stop.wait(self.period_s):
            for peer in self.peers:
                view.saw(peer, self.peer_answers(peer), time.monotonic())
            now = time.monotonic()
            live = view.live(now)
            target = self.inventory.assignment(set(live)).get(self.name, self.shard)
            if set(target) == set(self.shard) or now < retry_at:
                continue
            gone = sorted(set(self.peers) - live)
            if self._reshard(deployment, lock, target, gone):
                self.shard = tuple(target)
            else:
                retry_at = time.monotonic() + RESHARD_RETRY_S

    def _reshard(
        self, dep: Deployment, lock: threading.Lock, target: tuple[str, ...], gone: list[str]
    ) -> bool:
        added = [n for n in target if n not in self.shard]
        handed = [n for n in self.shard if n not in target]
        whys = []
        if added:
            of = ", ".join(gone)
            whys.append(f"adopting node(s) {', '.join(added)} of router(s) {of} (gone)")
        if handed:
            whys.append(f"handing node(s) {', '.join(handed)} back")
        why = "; ".join(whys)
        log.warning("router %s: %s", self.name, why)
        shard = self.inventory.shard(self.name, target)
        path = shard_file(self.workspace, self.name)
        record: dict = {"trigger": why, "nodes": list(target), "at": time.time()}
        try:
            with lock:  # not beside a rollout
                dep.reshard(shard)
                fenced = len(dep.fenced)
            path.write_text(shard.to_toml())  # what re-plans after failures plan for
            if self.on_reshard is None:
                raise PoolpipeError("no re-shard flow given")
            record["decision"] = self.on_reshard(dep.grpc_url, str(path), why)
            ok = bool(record["decision"].get("rolled_out"))
            record["fenced"] = dep.fenced[fenced:]
        except Exception as exc:  # the flow's own error, shown; serving goes on
            record["error"] = str(exc)
            ok = False
        log.warning(
            "router %s: re-shard %s",
            self.name,
            f"rolled out plan {record['decision'].get('plan_id')}" if ok else record.get("error"),
        )
        self.reshards.append(record)
        return ok
