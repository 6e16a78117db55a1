"""Cluster inventory: GPU types, counts, GPUs per server (sharing one NIC), allowed shares.

Clusters are read from TOML files in the layout of `profiles/ppipe-gpu/clusters.toml`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from poolpipe.domain.memory import DEFAULT_MEMORY_GB
from poolpipe.domain.tomlfile import read_toml
from poolpipe.errors import ClusterError, UnknownNameError


@dataclass(frozen=True)
class GpuPool:
    """All GPUs of one type in a cluster."""

    gpu: str
    count: int
    gpus_per_server: int  # these GPUs share one server NIC
    shares: tuple[int, ...] = (1,)  # v values the planner may use (1 = whole GPU)
    price_per_hour: float | None = None  # for the cost objective (any currency)
    # GPU memory (GB); None: the type's specification (memory.DEFAULT_MEMORY_GB), where known
    memory_gb: float | None = None

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ClusterError(f"GPU pool {self.gpu}: count must be >= 0, got {self.count}")
        if self.gpus_per_server < 1:
            raise ClusterError(f"GPU pool {self.gpu}: gpus_per_server must be >= 1")
        if not self.shares or any(v < 1 for v in self.shares):
            raise ClusterError(f"GPU pool {self.gpu}: shares must be a list of integers >= 1")
        p = self.price_per_hour
        if p is not None and not (p > 0 and p < float("inf")):
            raise ClusterError(f"GPU pool {self.gpu}: price_per_hour must be > 0, got {p}")
        g = self.memory_gb
        if g is not None and not (g > 0 and g < float("inf")):
            raise ClusterError(f"GPU pool {self.gpu}: memory_gb must be > 0, got {g}")

    @property
    def memory(self) -> float | None:
        """Its GPUs' memory (GB): as given, else the type's specification, else None (not
        known: not checked)."""
        return self.memory_gb if self.memory_gb is not None else DEFAULT_MEMORY_GB.get(self.gpu)


@dataclass(frozen=True)
class Cluster:
    name: str
    bandwidth_gbps: float  # effective NIC bandwidth per server
    pools: tuple[GpuPool, ...]
    # Different models' vGPUs may share a physical GPU only with this factor on the
    # latency of every vGPU of a shared (1/v, v > 1) GPU: a profile of share v is the same
    # block run v times at once, and what other models do to it was not measured. None
    # (default): a physical GPU holds one model's vGPUs only.
    mixed_model_interference: float | None = None

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0:
            raise ClusterError(f"cluster {self.name}: bandwidth_gbps must be > 0")
        f = self.mixed_model_interference
        if f is not None and not (1.0 <= f < float("inf")):
            raise ClusterError(
                f"cluster {self.name}: mixed_model_interference must be a latency factor >= 1 "
                f"(e.g. 1.2), got {f}; leave it out to keep models on GPUs of their own"
            )
        names = [p.gpu for p in self.pools]
        if len(set(names)) != len(names):
            raise ClusterError(f"cluster {self.name}: a GPU type is listed twice ({names})")
        if not self.pools:
            raise ClusterError(f"cluster {self.name}: no GPU pools")

    @property
    def mixes_models(self) -> bool:
        """May vGPUs of different models share a physical GPU (per-share packing)?"""
        return self.mixed_model_interference is not None

    def pool(self, gpu: str) -> GpuPool:
        for p in self.pools:
            if p.gpu == gpu:
                return p
        raise UnknownNameError(f"cluster {self.name} has no GPU type {gpu!r}")

    def prices(self) -> dict[str, float]:
        """price_per_hour of the GPU types that have one."""
        return {p.gpu: p.price_per_hour for p in self.pools if p.price_per_hour is not None}

    def without(self, lost: dict[str, int]) -> Cluster:
        """This cluster less `lost` GPUs per type (failed, in maintenance); the types and
        counts named must exist."""
        for gpu, n in lost.items():
            have = self.pool(gpu).count
            if not 0 <= n <= have:
                raise ClusterError(
                    f"cannot exclude {n} {gpu} GPUs: cluster {self.name} has {have} of them"
                )
        return replace(
            self, pools=tuple(replace(p, count=p.count - lost.get(p.gpu, 0)) for p in self.pools)
        )

    def with_counts(self, counts: dict[str, int]) -> Cluster:
        """This cluster with `counts` GPUs of the types named (at most what it has)."""
        return self.without({g: self.pool(g).count - n for g, n in counts.items()})

    def scaled(self, gpus: int) -> Cluster:
        """This cluster at `gpus` GPUs in all, named <name>@<gpus>: each type's count in
        proportion (largest remainders; every type keeps at least one), the same GPUs per
        server, shares and bandwidth."""
        total = self.total_gpus
        if gpus < len(self.pools) or total == 0:
            raise ClusterError(
                f"cluster {self.name} cannot be scaled to {gpus} GPUs: give at least "
                f"{len(self.pools)} (one per GPU type)"
            )
        exact = [p.count * gpus / total for p in self.pools]
        counts = [max(1, int(x)) for x in exact]
        order = sorted(range(len(exact)), key=lambda i: int(exact[i]) - exact[i])
        k = 0
        while sum(counts) != gpus:
            i = order[k % len(order)]
            step = 1 if sum(counts) < gpus else -1
            if counts[i] + step >= 1:
                counts[i] += step
            k += 1
        return replace(
            self,
            name=f"{self.name}@{gpus}",
            pools=tuple(replace(p, count=n) for p, n in zip(self.pools, counts, strict=True)),
        )

    @property
    def total_gpus(self) -> int:
        return sum(p.count for p in self.pools)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bandwidth_gbps": self.bandwidth_gbps,
            "gpus": [
                {
                    "type": p.gpu,
                    "count": p.count,
                    "gpus_per_server": p.gpus_per_server,
                    "shares": list(p.shares),
                    **({} if p.price_per_hour is None else {"price_per_hour": p.price_per_hour}),
                    **({} if p.memory_gb is None else {"memory_gb": p.memory_gb}),
                }
                for p in self.pools
            ],
            **(
                {}
                if self.mixed_model_interference is None
                else {"mixed_model_interference": self.mixed_model_interference}
            ),
        }

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any], where: str = "") -> Cluster:
        where = where or f"cluster {name}"
        try:
            pools = tuple(
                GpuPool(
                    gpu=str(g["type"]),
                    count=int(g["count"]),
                    gpus_per_server=int(g.get("gpus_per_server", 1)),
                    shares=tuple(int(v) for v in g.get("shares", [1])),
                    price_per_hour=(
                        None if g.get("price_per_hour") is None else float(g["price_per_hour"])
                    ),
                    memory_gb=None if g.get("memory_gb") is None else float(g["memory_gb"]),
                )
                for g in data["gpus"]
            )
            mixed = data.get("mixed_model_interference")
            return cls(
                name=name,
                bandwidth_gbps=float(data["bandwidth_gbps"]),
                pools=pools,
                mixed_model_interference=None if mixed is None else float(mixed),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ClusterError(
                f"{where}: malformed cluster entry ({type(e).__name__}: {e}); each cluster "
                "needs bandwidth_gbps and gpus = [{type, count, gpus_per_server, shares, "
                "price_per_hour and memory_gb (optional)}], and may give "
                "mixed_model_interference"
            ) from None


def load_clusters(path: Path) -> dict[str, Cluster]:
    """All clusters of a TOML file, by name."""
    path = Path(path)
    data = read_toml(path, "clusters", ClusterError)
    return {
        name: Cluster.from_dict(name, entry, where=f"{path} [{name}]")
        for name, entry in data.items()
        if isinstance(entry, dict)
    }


def load_cluster(path: Path, name: str) -> Cluster:
    """Cluster `name` of the file; `<name>@<N>`: that cluster scaled to N GPUs
    (Cluster.scaled)."""
    clusters = load_clusters(path)
    base, at, gpus = name.partition("@")
    if at and base in clusters:
        if not gpus.isdigit():
            raise ClusterError(f"cluster {name!r}: after @ give a GPU count, like {base}@32")
        return clusters[base].scaled(int(gpus))
    if name not in clusters:
        raise UnknownNameError(
            f"cluster {name!r} is not in {path}; known: {', '.join(sorted(clusters))}"
        )
    return clusters[name]
