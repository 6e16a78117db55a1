"""docs/design/planner.md's derived quantities for one model on one cluster, as precomputed arrays.

Everything that prices a partition or a pipeline (latency, vGPU throughput with NIC limits,
transfer time, batch wait, SLO budget) is computed here once, so that the enumeration
(vectorised) and `Plan.verify` (scalar) share one definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from poolpipe.domain.cluster import Cluster
from poolpipe.domain.memory import fits
from poolpipe.domain.profiles import ModelProfile
from poolpipe.errors import ProfileError

US_PER_S = 1e6
# The published planner's estimate of how long the first request of a batch waits for the
# batch to fill: BATCH_BUILD_FACTOR * (b - 1) / λ̂ seconds, λ̂ the model's NP throughput.
BATCH_BUILD_FACTOR = 1.3
# Block latencies are counted as at least this many µs (docs/design/planner.md: max(L, 1)).
MIN_BLOCK_LATENCY_US = 1.0


def margin_us(slo_us: float, margin: float) -> float:
    """round(μ·T) with halves rounded up, as the published plans do (28700.94 -> 28701)."""
    return float(math.floor(margin * slo_us + 0.5))


def transfer_us_per_sample(boundary_bytes: float, bandwidth_gbps: float) -> float:
    return boundary_bytes * 8.0 / (bandwidth_gbps * 1e9) * US_PER_S


@dataclass
class ModelCosts:
    """Price list of one model's partitions on one cluster.

    Index `kv` runs over `self.kvs`, the (GPU type, share) pairs that both the cluster allows
    and the profile has measured.
    """

    profile: ModelProfile
    cluster: Cluster
    slo_us: float
    margin: float
    est_throughput: float | None  # λ̂ (req/s) for the batch-wait term; None: term off
    allowed_shares: dict[str, tuple[int, ...]] | None = None  # restrict shares (np: v=1)
    # count each request's inputs on the first partition's server NIC (the paper's model
    # does not): its vGPU throughput limited by its share of that NIC, b x tau_in added to
    # every pipeline's latency
    inputs: bool = False
    # headroom planning (planner/headroom.py): the req/s a pool of this model is sized for,
    # its vGPUs then planned at the utilisation that leaves room for queueing; None: fluid
    headroom_rate: float | None = None
    kvs: list[tuple[str, int]] = field(init=False)
    tau_us: np.ndarray = field(init=False)  # per boundary i (leaving block i), per sample
    tau_in_us: float = field(init=False)  # the request's inputs, per sample (0: not counted)
    lat_prefix: np.ndarray = field(init=False)  # [kv, b-1, i]: Σ_{x<i} max(L,1); NaN if no b
    down: np.ndarray = field(init=False)  # [kv, i]: vGPU samples/s receiving into block i
    up: np.ndarray = field(init=False)  # [kv, j]: vGPU samples/s sending after block j-1
    # [kv, b-1]: a vGPU of any partition at batch b fits its share of the GPU's memory
    fits_memory: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        p = self.profile
        B = p.num_blocks
        self.kvs = []
        for pool in self.cluster.pools:
            if pool.count == 0:
                continue
            shares = pool.shares
            if self.allowed_shares is not None:
                shares = tuple(v for v in shares if v in self.allowed_shares.get(pool.gpu, ()))
            self.kvs.extend((pool.gpu, v) for v in shares if (pool.gpu, v) in p.tables)
        self.tau_us = np.array(
            [transfer_us_per_sample(s, self.cluster.bandwidth_gbps) for s in p.boundary_bytes],
            dtype=float,
        )
        self.tau_in_us = 0.0
        if self.inputs:
            if p.input_bytes is None:
                raise ProfileError(
                    f"model {p.name}: the size of its inputs is not known, so they cannot be "
                    "counted on the NICs; import its profile from a PPipe folder with "
                    "layers/<model>/cuts.json and shapes.json, or plan without counting inputs"
                )
            self.tau_in_us = transfer_us_per_sample(p.input_bytes, self.cluster.bandwidth_gbps)
        self.max_batch = max((p.tables[kv].max_batch for kv in self.kvs), default=0)
        K = len(self.kvs)
        self.lat_prefix = np.full((K, max(self.max_batch, 1), B + 1), np.nan)
        self.down = np.full((K, B + 1), np.inf)
        self.up = np.full((K, B + 1), np.inf)
        # where models may share a GPU, a shared GPU's vGPUs run slower by the cluster's
        # interference factor (Cluster.mixed_model_interference)
        mixed = self.cluster.mixed_model_interference or 1.0
        for k, (gpu, v) in enumerate(self.kvs):
            table = np.maximum(p.tables[(gpu, v)].latency_us, MIN_BLOCK_LATENCY_US)
            if v > 1:
                table = table * mixed
            nb = table.shape[1]
            self.lat_prefix[k, :nb, 0] = 0.0
            self.lat_prefix[k, :nb, 1:] = np.cumsum(table.T, axis=1)
            h = self.cluster.pool(gpu).gpus_per_server
            with np.errstate(divide="ignore"):
                per_vgpu = US_PER_S / (self.tau_us * v * h)  # inf where the boundary is 0 B
            self.down[k, 1:B] = per_vgpu  # block i > 0 receives boundary i-1
            self.up[k, 1:B] = per_vgpu  # partition ending at j < B sends boundary j-1
            if self.tau_in_us > 0:  # block 0 receives the request's inputs
                self.down[k, 0] = US_PER_S / (self.tau_in_us * v * h)
        memory = [self.cluster.pool(gpu).memory for gpu, _ in self.kvs]
        self.fits_memory = np.array(
            [
                [fits(p, memory[k], v, b) for b in range(1, max(self.max_batch, 1) + 1)]
                for k, (_, v) in enumerate(self.kvs)
            ],
            dtype=bool,
        ).reshape(K, max(self.max_batch, 1))

    # ------------------------------------------------------------------ scalar accessors

    @property
    def num_blocks(self) -> int:
        return self.profile.num_blocks

    def kv_index(self, gpu: str, share: int) -> int:
        return self.kvs.index((gpu, share))

    def budget_us(self) -> float:
        """Largest planned end-to-end latency allowed: T - round(μT)."""
        return self.slo_us - margin_us(self.slo_us, self.margin)

    def batch_wait_us(self, batch: int) -> float:
        if self.est_throughput is None or batch <= 1:
            return 0.0
        if self.est_throughput <= 0:
            return math.inf  # no NP estimate: batches cannot be expected to fill
        return BATCH_BUILD_FACTOR * US_PER_S * (batch - 1) / self.est_throughput

    def partition_latency_us(self, kv: int, batch: int, start: int, end: int) -> float:
        if batch > self.lat_prefix.shape[1]:
            return math.nan
        row = self.lat_prefix[kv, batch - 1]
        return float(row[end] - row[start])

    def vgpu_throughput(self, kv: int, batch: int, start: int, end: int) -> float:
        lat = self.partition_latency_us(kv, batch, start, end)
        if not lat > 0:
            return 0.0
        return float(min(batch * US_PER_S / lat, self.down[kv, start], self.up[kv, end]))

    def transfer_out_us(self, batch: int, end: int) -> float:
        """Time to send a batch's feature map out of a partition ending at block `end`."""
        return 0.0 if end >= self.num_blocks else batch * float(self.tau_us[end - 1])

    def pipeline_latency_us(self, batch: int, parts: list[tuple[int, int, int]]) -> float:
        """End-to-end planned latency of partitions [(kv, start, end), ...] at one batch."""
        compute = sum(self.partition_latency_us(kv, batch, s, e) for kv, s, e in parts)
        transfer = sum(self.transfer_out_us(batch, e) for _, _, e in parts[:-1])
        return compute + transfer + batch * self.tau_in_us + self.batch_wait_us(batch)
