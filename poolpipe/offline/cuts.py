"""Where a model can be cut, and how to cut it into blocks of about equal runtime.

A model is a list of layers (nodes) in topological order. Position i (0..N) is the cut
right after the first i layers; the tensors crossing it are those made before it (or fed to
the model) and still needed after it (or returned by the model). Weights and constants never
cross: every block carries its own. A cut is *valid* when few, small tensors cross it.

Pre-partitioning picks N - 1 valid cuts so that blocks take about equal time, either with
the paper's greedy walk or exactly (the cuts that minimise the squared deviations of block
times from their mean, by dynamic programming). Nothing here reads a file or a clock:
`poolpipe.offline.onnxgraph` and the shipped layer data both produce a `CutTable`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poolpipe.errors import ModelError

METHODS = ("balanced", "greedy")


@dataclass(frozen=True)
class CutPolicy:
    max_tensors: int = 1  # at most this many tensors may cross a valid cut
    max_bytes: float = math.inf  # ... together at most this many bytes at batch 1


@dataclass(frozen=True)
class CutTable:
    """A model's layers in topological order, their latencies, and what crosses each cut."""

    model: str
    layers: tuple[str, ...]
    latency_us: tuple[float, ...]  # per layer (batch 1)
    crossing: tuple[tuple[str, ...], ...]  # [i]: tensors crossing position i (0..N)
    crossing_bytes: tuple[float, ...]  # [i]: their total size at batch 1 (nan: unknown)
    # [i]: tensors crossing position i that are no feature maps (shapes, indices, tensors
    # without the batch first): no cut is made there, since stages pass only feature maps.
    # Empty: all are feature maps (tables without tensor types).
    not_data: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.layers)
        if len(self.latency_us) != n or len(self.crossing) != n + 1:
            raise ModelError(
                f"{self.model}: cut table is inconsistent ({n} layers, {len(self.latency_us)} "
                f"latencies, {len(self.crossing)} cut positions; expected N, N and N + 1)"
            )
        if self.not_data and len(self.not_data) != n + 1:
            raise ModelError(f"{self.model}: cut table is inconsistent (not_data per position)")

    def carries_data(self, i: int) -> bool:
        """Only feature maps cross position i."""
        return not self.not_data or not self.not_data[i]

    def valid_cuts(self, policy: CutPolicy) -> list[int]:
        """Internal positions 1..N-1 where the policy allows a cut."""
        return [
            i
            for i in range(1, len(self.layers))
            if 0 < len(self.crossing[i]) <= policy.max_tensors
            and self.crossing_bytes[i] <= policy.max_bytes
            and self.carries_data(i)
        ]

    def shape_cuts(self) -> int:
        """Internal positions crossed by a tensor that is no feature map."""
        return sum(not self.carries_data(i) for i in range(1, len(self.layers)))


@dataclass(frozen=True)
class Partitioning:
    model: str
    method: str
    cuts: tuple[int, ...]  # positions, ascending, first 0 and last N
    block_us: tuple[float, ...]
    policy: CutPolicy

    @property
    def blocks(self) -> list[tuple[int, int]]:
        return list(zip(self.cuts[:-1], self.cuts[1:], strict=True))

    @property
    def balance(self) -> float:
        """Slowest block over fastest block (1.0 is perfect)."""
        lo = min(self.block_us)
        return max(self.block_us) / lo if lo > 0 else math.inf


def prepartition(
    table: CutTable,
    n_blocks: int = 10,
    *,
    policy: CutPolicy | None = None,
    method: str = "balanced",
    relax: bool = True,
    target_balance: float = 1.5,
) -> Partitioning:
    """Cut `table` into `n_blocks` blocks of about equal latency at valid cuts.

    With `relax`, when the policy leaves too few valid cuts, or none that balance the blocks
    to within `target_balance` (slowest / fastest), cuts crossed by one more tensor are
    allowed, up to the most any cut of the model has; the first policy that reaches the
    target wins, else the best balance found. The result says which policy was used.
    """
    if method not in METHODS:
        raise ModelError(f"unknown pre-partitioning method {method!r}; choose {', '.join(METHODS)}")
    if n_blocks < 1:
        raise ModelError(f"{table.model}: the number of blocks must be >= 1, got {n_blocks}")
    policy = policy or CutPolicy()
    widest = max((len(c) for c in table.crossing[1:-1]), default=0)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(table.latency_us, dtype=float))])
    best: Partitioning | None = None
    while True:
        cuts = table.valid_cuts(policy)
        if len(cuts) >= n_blocks - 1:
            part = _partition(table, prefix, n_blocks, cuts, method, policy)
            if best is None or part.balance < best.balance:
                best = part
            if part.balance <= target_balance:
                break
        if not relax or policy.max_tensors >= widest:
            break
        policy = CutPolicy(policy.max_tensors + 1, policy.max_bytes)
    if best is None:
        shapes = table.shape_cuts()
        why = (
            f"; {shapes} of its {len(table.layers) - 1} positions are crossed by a shape or "
            "index tensor (or one without the batch first), which stages cannot pass"
            if shapes
            else ""
        )
        more = (
            "allow more tensors or bytes per cut, or ask for fewer blocks"
            if policy.max_tensors < widest or math.isfinite(policy.max_bytes)
            else "ask for fewer blocks"
        )
        raise ModelError(
            f"{table.model}: pre-partitioning needs {n_blocks - 1} valid cuts but only "
            f"{len(cuts)} exist with at most {policy.max_tensors} crossing tensor(s) and "
            f"{policy.max_bytes:g} bytes{why}; {more}"
        )
    return best


def given_cuts(table: CutTable, cuts: Sequence[int]) -> Partitioning:
    """The blocks between the given cut positions (ascending, 0 and N included), each cut
    crossed by at least one tensor; for models built with their blocks known (shadows)."""
    n = len(table.layers)
    cuts = tuple(int(c) for c in cuts)
    if (
        len(cuts) < 2
        or cuts[0] != 0
        or cuts[-1] != n
        or any(b <= a for a, b in itertools.pairwise(cuts))
    ):
        raise ModelError(
            f"{table.model}: cuts {list(cuts)} must rise from 0 to the model's {n} layers"
        )
    empty = [c for c in cuts[1:-1] if not table.crossing[c]]
    if empty:
        raise ModelError(f"{table.model}: no tensor crosses cut position {empty[0]}")
    shaped = [c for c in cuts[1:-1] if not table.carries_data(c)]
    if shaped:
        raise ModelError(
            f"{table.model}: cut position {shaped[0]} is crossed by "
            f"{', '.join(repr(t) for t in table.not_data[shaped[0]])}, which is no feature "
            "map (a shape or index tensor, or one without the batch first); cut elsewhere"
        )
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(table.latency_us, dtype=float))])
    widest = max((len(table.crossing[c]) for c in cuts[1:-1]), default=1)
    block_us = tuple(float(prefix[b] - prefix[a]) for a, b in itertools.pairwise(cuts))
    return Partitioning(table.model, "given", cuts, block_us, CutPolicy(widest))


def _partition(
    table: CutTable,
    prefix: np.ndarray,
    n_blocks: int,
    cuts: list[int],
    method: str,
    policy: CutPolicy,
) -> Partitioning:
    chosen = (
        _greedy(prefix, cuts, n_blocks) if method == "greedy" else _balanced(prefix, cuts, n_blocks)
    )
    bounds = (0, *chosen, len(table.layers))
    block_us = tuple(float(prefix[b] - prefix[a]) for a, b in itertools.pairwise(bounds))
    return Partitioning(table.model, method, bounds, block_us, policy)


def _greedy(prefix: np.ndarray, cuts: Sequence[int], n_blocks: int) -> list[int]:
    """The paper's walk: close block k at the valid cut nearest to k/N of the total time,
    keeping enough cuts for the blocks still to come."""
    total = prefix[-1]
    chosen: list[int] = []
    lo = 0  # index into cuts of the first cut still allowed
    for k in range(1, n_blocks):
        hi = len(cuts) - (n_blocks - 1 - k)  # leave one cut per block to come
        target = total * k / n_blocks
        best = min(range(lo, hi), key=lambda j: abs(prefix[cuts[j]] - target))
        chosen.append(cuts[best])
        lo = best + 1
    return chosen


def _balanced(prefix: np.ndarray, cuts: Sequence[int], n_blocks: int) -> list[int]:
    """Exact: the valid cuts minimising the sum of squared deviations of block times from
    the mean (unlike min-max, this keeps the fastest block from shrinking to nothing)."""
    pos = np.asarray(cuts, dtype=int)
    t = prefix[pos]  # time before each candidate cut
    total = prefix[-1]
    mean = total / n_blocks
    m = len(pos)
    f = (t - mean) ** 2  # [c]: best cost of the blocks before cut c (one block so far)
    back: list[np.ndarray] = []
    for _ in range(2, n_blocks):
        g = np.full(m, np.inf)
        arg = np.zeros(m, dtype=int)
        for c in range(1, m):
            cand = f[:c] + (t[c] - t[:c] - mean) ** 2
            j = int(np.argmin(cand))
            g[c], arg[c] = cand[j], j
        back.append(arg)
        f = g
    c = int(np.argmin(f + (total - t - mean) ** 2))
    chosen = [c]
    for arg in reversed(back):
        c = int(arg[c])
        chosen.append(c)
    return [int(pos[c]) for c in reversed(chosen)]


def crossing_from_lifetimes(
    n_layers: int, lifetimes: Sequence[tuple[str, int, int, float]]
) -> tuple[tuple[tuple[str, ...], ...], tuple[float, ...]]:
    """Tensors crossing each position, from (name, producer index or -1 for a model input,
    last use index or n_layers for a model output, bytes at batch 1)."""
    starts: list[list[int]] = [[] for _ in range(n_layers + 2)]
    for k, (_, p, _, _) in enumerate(lifetimes):
        starts[p + 1].append(k)
    crossing: list[tuple[str, ...]] = []
    sizes: list[float] = []
    live: dict[int, None] = {}
    for i in range(n_layers + 1):
        for k in starts[i]:
            live[k] = None
        for k in [k for k in live if lifetimes[k][2] < i]:
            del live[k]
        crossing.append(tuple(lifetimes[k][0] for k in live))
        sizes.append(float(sum(lifetimes[k][3] for k in live)))
    return tuple(crossing), tuple(sizes)
