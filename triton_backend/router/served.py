"""What the router serves and holds: its own data for a served plan (partition names per
pool, each model's tensors as clients see them), and a client's request with its rows as
they travel through the runtime (a row is one runtime entry's payload)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poolpipe.errors import PoolpipeError
from poolpipe.offline.partitions import TensorSpec, row_bytes
from poolpipe.runtime import DROPPED, FAILED, Outcome, ServedPlan
from poolpipe.scheduler import DataPlane, Topology

DROP_MARKER = "POOLPIPE_DROPPED"
BAD_REQUEST_MARKER = "POOLPIPE_BAD_REQUEST"
FAIL_MARKER = "POOLPIPE_STAGE_FAILED"
REFUSED_MARKER = "POOLPIPE_REFUSED"  # the plan served cannot serve it (the server's condition)
# Triton's own refusals ahead of the door (door_config's queue bounds: the router's host
# fell behind), also the server's condition: UNAVAILABLE, HTTP 503
QUEUE_REFUSALS = ("Exceeds maximum queue size", "Request timeout expired")


def refused(text: str) -> bool:
    """Whether an error's text is a refusal: the plan's, or the router's Triton's queue."""
    return REFUSED_MARKER in text or any(r in text for r in QUEUE_REFUSALS)


@dataclass(frozen=True)
class ModelIO:
    """A served model's tensors as clients see them (batch dimension first)."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


def input_bytes(ios: Iterable[ModelIO]) -> dict[str, float]:
    """Per served model, the bytes of one request's inputs on the wire (a row of each)."""
    return {io.name: row_bytes(io.inputs) for io in ios}


@dataclass(frozen=True)
class RouterPlan:
    """The router's own data for a served plan (ServedPlan.adapter)."""

    pool_partition: Mapping[int, str]  # pool id -> partition model name
    io: Mapping[str, ModelIO]  # served model name -> its tensors


def served_plan(
    topo: Topology,
    plane: DataPlane,
    pool_partition: Mapping[int, str],
    vgpu_node: Mapping[int, str],
    io: Sequence[ModelIO],
) -> ServedPlan:
    """What the runtime serves a plan with: each vGPU's node by its gRPC address."""
    by_name = {m.name: m for m in io}
    for m in topo.models:
        if m.name not in by_name:
            raise PoolpipeError(f"router: no tensor description for plan model {m.name}")
    return ServedPlan(topo, plane, dict(vgpu_node), RouterPlan(pool_partition, by_name))


# How the door answers a request: outputs (in the model's output order) or None, the
# error's code (None, "INVALID_ARG", "UNAVAILABLE" or "INTERNAL") and its message.
Reply = Callable[[list[np.ndarray] | None, str | None, str], None]

_CODES = {DROPPED: ("UNAVAILABLE", DROP_MARKER), FAILED: ("INTERNAL", FAIL_MARKER)}


class ClientRequest:
    """One client request of n rows: answered once, when every row is done or at the first
    row that is dropped or fails."""

    __slots__ = ("io", "reply", "rows", "trace", "waiting")

    def __init__(self, io: ModelIO, n: int, reply: Reply, trace: Any = None):
        self.io = io
        self.reply: Reply | None = reply
        self.rows: list[dict[str, np.ndarray] | None] = [None] * n
        self.waiting = n
        self.trace = trace  # its notes while traced (router/tracing.py), else None

    def settle(self, row: int, outcome: Outcome, reason: str, result: Any) -> None:
        reply = self.reply
        if reply is None:
            return
        if outcome in _CODES:
            self.reply = None
            code, marker = _CODES[outcome]
            reply(None, code, f"{marker}: {reason}")
            return
        self.rows[row] = result
        self.waiting -= 1
        if self.waiting == 0:
            self.reply = None
            rows = self.rows
            if len(rows) == 1:
                outs = [rows[0][t.name] for t in self.io.outputs]  # type: ignore[index]
            else:
                outs = [np.concatenate([r[t.name] for r in rows]) for t in self.io.outputs]  # type: ignore[index]
            reply(outs, None, "")


@dataclass
class RequestRow:
    """One row of a client request, as the runtime's entry carries it: its request, its
    place there, its input tensors (kept for a retry) and, after each stage, that stage's
    outputs (the next stage's inputs)."""

    request: ClientRequest
    row: int
    inputs: list[np.ndarray]
    tensors: list[np.ndarray] = field(default_factory=list)
