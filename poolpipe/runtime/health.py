"""Node health as the runtime sees it: which stage-worker nodes are out of service — down
(a stage call on them failed, their watch connection broke, or a check found them not
ready) or drained (their operator took them out) —, which models have no live path left
because of it, what each model can still serve, and the watch that asks a down node every
so often whether it serves again. A node's vGPUs leave and return together
(ServedPlan.vgpu_node). Every change of a node's state is told to `on_change` (the
driver logs and counts it) with the runtime clock's time."""

from __future__ import annotations

from collections.abc import Callable

from poolpipe.runtime.ports import Clock, ServedPlan

# A failed node is asked whether it serves again this often (µs).
NODE_CHECK_EVERY_US = 500_000.0

# The states a node change reports (NodeHealth.on_change).
DOWN, BACK, DRAINED, UNDRAINED = "down", "back", "drained", "undrained"
NODE_STATES = (DOWN, BACK, DRAINED, UNDRAINED)


class NodeHealth:
    """The nodes out of service (`down`: failed; `drained`: taken out by their operator),
    since when (`since`, clock µs), and the models of the plan served with no live path
    (`no_path`, model indexes). `check(node)` is called every `check_every_us` while a node
    is down (the executor finds out and reports back); drained nodes are not checked."""

    __slots__ = (
        "_check",
        "_clock",
        "check_every_us",
        "down",
        "drained",
        "no_path",
        "on_change",
        "out",
        "since",
        "unwatched",
    )

    def __init__(self, clock: Clock, check: Callable[[str], None], check_every_us: float):
        self._clock = clock
        self._check = check
        self.check_every_us = check_every_us
        self.down: set[str] = set()
        self.drained: set[str] = set()
        self.out: set[str] = set()  # down | drained: no new batch goes to them
        self.since: dict[str, float] = {}  # node -> when its state last changed
        self.unwatched: set[str] = set()  # lost their watch connection, not open again
        self.no_path: set[int] = set()
        self.on_change: Callable[[str, str, str, float], None] | None = None

    def kept(self, served: ServedPlan, pipeline: int) -> float:
        """The share of a pipeline's planned throughput its vGPUs in service keep: a pool
        does the share of its work that its vGPUs up can (any of them takes any batch), and
        the pipeline keeps the share its most-hit pool keeps (0: no live path through it)."""
        topo, vn, out = served.topo, served.vgpu_node, self.out
        return min(
            sum(vn[v] not in out for v in topo.pools[p].vgpus) / len(topo.pools[p].vgpus)
            for p in topo.pipelines[pipeline].pools
        )

    def has_live_path(self, served: ServedPlan, model: int) -> bool:
        """Whether some pipeline of `model` has a vGPU in service in every pool."""
        return any(self.kept(served, i) > 0 for i in served.topo.models[model].pipelines)

    def live_throughput(self, served: ServedPlan) -> dict[str, float]:
        """Each served model's planned req/s on the vGPUs in service now (see kept)."""
        topo = served.topo
        return {
            m.name: sum(topo.pipelines[i].throughput * self.kept(served, i) for i in m.pipelines)
            for m in topo.models
        }

    def refresh(self, served: ServedPlan) -> None:
        """Which models of `served` have no live path left (their requests fail at once)."""
        self.out = self.down | self.drained
        self.no_path = {
            m for m in range(len(served.topo.models)) if not self.has_live_path(served, m)
        }

    def no_path_reason(self, served: ServedPlan, model: int) -> str:
        name = served.topo.models[model].name
        parts = []
        if self.down:
            parts.append(f"node(s) {', '.join(sorted(self.down))} down")
        if self.drained:
            parts.append(f"node(s) {', '.join(sorted(self.drained))} drained")
        return f"no live path for model {name}: {'; '.join(parts)}"

    def _changed(self, node: str, state: str, why: str, now: float) -> None:
        self.since[node] = now
        if self.on_change is not None:
            self.on_change(node, state, why, now)

    def failed(self, node: str, served: ServedPlan, now: float, why: str = "") -> None:
        """`node` failed: out of service, and watched until it answers."""
        self.down.add(node)
        self.refresh(served)
        self._changed(node, DOWN, why, now)
        self.watch(node, now)

    def back(self, node: str, served: ServedPlan, now: float) -> None:
        """`node` answered again: in service (unless its operator drained it)."""
        self.down.discard(node)
        self.refresh(served)
        self._changed(node, BACK, "", now)

    def drain(self, node: str, served: ServedPlan, now: float) -> None:
        self.drained.add(node)
        self.refresh(served)
        self._changed(node, DRAINED, "", now)

    def undrain(self, node: str, served: ServedPlan, now: float) -> None:
        self.drained.discard(node)
        self.refresh(served)
        self._changed(node, UNDRAINED, "", now)

    def watch(self, node: str, now: float) -> None:
        """Ask about `node` again after the check period (while it is still down)."""

        def check() -> None:
            if node in self.down:
                self._check(node)

        self._clock.call_at(now + self.check_every_us, check)
