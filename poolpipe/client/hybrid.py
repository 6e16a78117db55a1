"""A hybrid client (Graft): runs a model's first blocks itself with ONNX Runtime and sends
the feature map at an entry block to the router, what is left of its SLO as the request's
`slo_ms`.

The client cuts the model's blocks one by one out of the onboarded model's files, as the
server's partitions are cut (`make_partition`: fp16 between blocks, the tensors the
server's stages pass), times each on this machine (`measure`), and for each request
chooses its entry block by Neurosurgeon's rule (domain.entry.choose_entry) among the
entries the plan serves: its blocks' measured time, the upload of what enters the block
at the uplink rate it is given, the server's blocks from the model's profile (over 1 -
the plan's margin). The door's model of each entry is the plan's stream entering there
(`doors`: a plan of entry streams, planner/graft.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from poolpipe.domain.entry import choose_entry, plan_segments
from poolpipe.errors import PoolpipeError


def doors(meta: Mapping, model: str) -> dict[int, str]:
    """The plan's door model for each entry block of `model` (the first stream entering
    there), from a plan of entry streams' meta."""
    recorded = meta.get("apps") or {}
    segments = plan_segments(meta)
    out: dict[int, str] = {}
    for name, rec in recorded.items():
        first = rec["models"][0]
        seg = segments.get(first)
        base, entry = (seg.model, seg.start) if seg is not None else (first, 0)
        if base == model:
            out.setdefault(entry, name)
    if not out:
        raise PoolpipeError(f"the plan serves no stream of model {model}: plan its streams")
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class HybridAnswer:
    outputs: dict[str, np.ndarray]
    entry: int  # the block the server began at
    door: str  # the door's model it was sent to
    client_ms: float  # this machine's blocks
    total_ms: float  # from the call to the answer
    budget_ms: float  # the slo_ms sent


class HybridClient:
    """Blocks [0, p) here, the rest at the router (module doc). `infer` is the call."""

    def __init__(
        self,
        url: str,
        whole: Path,
        block_layers: list[tuple[int, int]],
        doors: Mapping[int, str],
        server_us: Sequence[float],
        slo_us: float,
        workdir: Path,
        margin: float = 0.4,
    ):
        from poolpipe.offline.onnxgraph import session
        from poolpipe.offline.partitions import make_partition

        n = len(block_layers)
        if len(server_us) != n:
            raise PoolpipeError(f"server latencies: one per block ({n}), got {len(server_us)}")
        self.url, self.doors, self.slo_us, self.margin = url, dict(doors), slo_us, margin
        self.server_us = list(server_us)
        last = max(self.doors)
        self.blocks = [
            make_partition(whole, "client", block_layers, i, i + 1, workdir) for i in range(last)
        ]
        self.sessions = [session(b.path) for b in self.blocks]
        self.client_us = [0.0] * n  # per block, measured (blocks past the last entry: 0)
        self.upload_bytes = [0.0] * n
        self._client: Any = None  # tritonclient.grpc.InferenceServerClient, once used

    def _run(self, x: dict[str, np.ndarray], upto: int) -> dict[str, np.ndarray]:
        """Blocks [0, upto) on the inputs; the feature map entering block `upto`."""
        for sess in self.sessions[:upto]:
            x = {f"in_{k}": a for k, a in enumerate(sess.run(None, x))}
        return x

    def measure(self, x: dict[str, np.ndarray], repeats: int = 5) -> None:
        """Time each block on this machine (the median of `repeats` runs) and size what
        enters each block (the bytes a request sends entering there)."""
        self.upload_bytes[0] = float(sum(a.nbytes for a in x.values()))
        runs: list[list[float]] = [[] for _ in self.blocks]
        for _ in range(repeats):
            cur = x
            for i, sess in enumerate(self.sessions):
                t0 = time.perf_counter()
                outs = sess.run(None, cur)
                runs[i].append((time.perf_counter() - t0) * 1e6)
                cur = {f"in_{k}": a for k, a in enumerate(outs)}
                self.upload_bytes[i + 1] = float(sum(a.nbytes for a in outs))
        for i, r in enumerate(runs):
            self.client_us[i] = statistics.median(r)

    def choose(self, uplink_bytes_per_s: float, slo_us: float | None = None) -> tuple[int, float]:
        """The entry block and the budget left the server (µs), Neurosurgeon's rule among
        the plan's entries (`measure` first)."""
        upload = [b if b > 0 or i == 0 else np.inf for i, b in enumerate(self.upload_bytes)]
        return choose_entry(
            self.client_us,
            upload,
            uplink_bytes_per_s,
            self.server_us,
            self.slo_us if slo_us is None else slo_us,
            self.margin,
            entries=list(self.doors),
        )

    def infer(
        self, x: dict[str, np.ndarray], uplink_bytes_per_s: float, slo_us: float | None = None
    ) -> HybridAnswer:
        """One request: blocks [0, p) here, the rest at the router with what is left of the
        SLO (`slo_us`, default the client's) after its blocks and the upload (estimated at
        `uplink_bytes_per_s`) as its slo_ms."""
        import tritonclient.grpc as grpc

        t0 = time.perf_counter()
        slo = self.slo_us if slo_us is None else slo_us
        entry, _ = self.choose(uplink_bytes_per_s, slo)
        fmap = self._run(x, entry)
        client_ms = (time.perf_counter() - t0) * 1e3
        if self._client is None:
            self._client = grpc.InferenceServerClient(self.url)
        inputs = []
        for name, a in fmap.items():
            i = grpc.InferInput(name, list(a.shape), "FP16" if a.dtype == np.float16 else "FP32")
            i.set_data_from_numpy(a)
            inputs.append(i)
        door = self.doors[entry]
        upload_ms = sum(a.nbytes for a in fmap.values()) / uplink_bytes_per_s * 1e3
        budget_ms = slo / 1e3 - client_ms - upload_ms  # what is left when it reaches the router
        if budget_ms <= 0:
            raise PoolpipeError(
                f"the client's blocks ({client_ms:.1f} ms) and the upload ({upload_ms:.1f} ms) "
                f"leave nothing of its {slo / 1e3:g} ms SLO"
            )
        answer = self._client.infer(door, inputs, parameters={"slo_ms": budget_ms})
        outputs = {o.name: answer.as_numpy(o.name) for o in answer.get_response().outputs}
        total_ms = (time.perf_counter() - t0) * 1e3
        return HybridAnswer(outputs, entry, door, client_ms, total_ms, budget_ms)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
