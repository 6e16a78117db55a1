"""A real GPU behind the router's executor, to check the emulation against it
(scripts/bench_gpu.py; docs/design/emulation.md). Needs PyTorch; runs where a GPU is.

- `resnet50_blocks`: a ResNet-50 written in PyTorch (random weights: times, not answers,
  are what is checked), cut into six blocks: the stem, its four stages, the head.
- `Worker`: one vGPU, a thread's worth of work on its own CUDA stream with one CUDA graph
  per (block, batch size), so that a stage is a few graph launches rather than hundreds of
  kernel launches from Python: its time is the GPU's, as with a TensorRT engine. The
  workers of one GPU run at once, as its MPS shares (vGPUs) would.
- `profile_blocks`: each block's time per batch size with `share` workers running it at
  once (the profiles' per-share latencies include that interference), in the layout of the
  PPipe profiles (block-latency/<model>-<GPU>-<share>.csv).
- `GpuStages`: the router's stage client over the workers (fake_stages.py's nodes, each
  partition run on the GPU instead of asleep on the loop). Feature maps stay on the GPU;
  between stages the router carries one int64 handle per row. Every answer's logits are
  compared with the whole model's, so a pipeline that computes the wrong thing is seen.

Without CUDA, everything runs eagerly on the CPU (for tests of this module; its times mean
nothing there).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from testbed.fake_stages import Call, FakePartition, FakeStages
from triton_backend.router.stages import StageUnreachable

BLOCK_NAMES = ("stem", "stage1", "stage2", "stage3", "stage4", "head")


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        out = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == out
            else nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.skip(x))


def resnet50_blocks(classes: int = 1000, seed: int = 0) -> list[nn.Module]:
    """ResNet-50 (He et al.) as six blocks, in eval mode, weights drawn from `seed`."""
    torch.manual_seed(seed)
    stem = nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    )
    stages: list[nn.Module] = []
    cin = 64
    for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        layers = []
        for k in range(count):
            layers.append(_Bottleneck(cin, width, stride if k == 0 else 1))
            cin = width * 4
        stages.append(nn.Sequential(*layers))
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))
    return [b.eval() for b in (stem, *stages, head)]


@dataclass
class Gpu:
    """The device the blocks run on, the blocks and their per-row input shapes."""

    blocks: list[nn.Module]
    image: int
    device: torch.device
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # block b's input per row

    @classmethod
    def open(cls, image: int, seed: int = 0) -> Gpu:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda" if cuda else "cpu")
        if cuda:  # fp32 on the CUDA cores, deterministic algorithm choice
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.benchmark = False
        blocks = [b.to(device) for b in resnet50_blocks(seed=seed)]
        gpu = cls(blocks, image, device)
        x = torch.zeros((1, 3, image, image), device=device)
        with torch.no_grad():
            for b in blocks:
                gpu.shapes.append(tuple(x.shape[1:]))
                x = b(x)
        gpu.shapes.append(tuple(x.shape[1:]))  # the model's output
        return gpu

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def name(self) -> str:
        """The GPU's type as the profiles name it (H100, H200, ...; cpu without CUDA)."""
        if not self.cuda:
            return "cpu"
        full = torch.cuda.get_device_name(self.device)
        for word in full.replace("-", " ").split():
            if word[:1] in "AHLPTVB" and any(c.isdigit() for c in word):
                return word
        return full.replace(" ", "_")

    def boundary_bytes(self) -> list[int]:
        """Bytes per sample at each block boundary: the input, then each block's output."""
        return [int(np.prod(s)) * 4 for s in self.shapes]

    def image_batch(self, n: int) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn((1, *self.shapes[0]), generator=g)
        return x.expand(n, *self.shapes[0]).contiguous().to(self.device)


class Worker:
    """One vGPU: its own stream and a CUDA graph per (block, batch size) it was made for."""

    def __init__(self, gpu: Gpu, batches: Sequence[int], blocks: Sequence[int] | None = None):
        self.gpu = gpu
        self.stream = torch.cuda.Stream(gpu.device) if gpu.cuda else None
        self.pool = ThreadPoolExecutor(1)  # one call at a time: a model instance
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor]] = {}
        wanted = range(len(gpu.blocks)) if blocks is None else blocks
        if gpu.cuda:
            for b in wanted:
                for n in batches:
                    self.graphs[b, n] = self._capture(b, n)

    def _capture(self, b: int, n: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        block = self.gpu.blocks[b]
        x = torch.zeros((n, *self.gpu.shapes[b]), device=self.gpu.device)
        assert self.stream is not None
        with torch.no_grad():
            self.stream.wait_stream(torch.cuda.current_stream(self.gpu.device))
            with torch.cuda.stream(self.stream):
                for _ in range(2):  # warm up (cuDNN's choices) before the capture
                    block(x)
            torch.cuda.current_stream(self.gpu.device).wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                y = block(x)
        return graph, x, y

    def run(self, first: int, last: int, x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Blocks first..last on batch x (or the rows to batch, each made on another
        worker's stream, which that worker has waited for); the output, a fresh tensor,
        once the GPU is done with it."""
        with torch.no_grad():
            if not self.gpu.cuda:
                x = torch.cat(x) if isinstance(x, list) else x
                for b in range(first, last + 1):
                    x = self.gpu.blocks[b](x)
                return x
            assert self.stream is not None
            with torch.cuda.stream(self.stream):  # the batching copy too: on this stream
                x = torch.cat(x) if isinstance(x, list) else x
                for b in range(first, last + 1):
                    graph, static_in, static_out = self.graphs[b, len(x)]
                    static_in.copy_(x)
                    graph.replay()
                    x = static_out
                out = x.clone()
            self.stream.synchronize()
        return out

    def warm(self) -> None:
        """Run every graph once on the worker's own thread (its first calls there pay for
        the thread and its CUDA state, not for the blocks)."""
        shapes = self.gpu.shapes
        for b, n in self.graphs or [(b, 1) for b in range(len(self.gpu.blocks))]:
            x = torch.zeros((n, *shapes[b]), device=self.gpu.device)
            self.pool.submit(self.run, b, b, x).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def profile_blocks(
    workers: Sequence[Worker], batches: Sequence[int], share: int, reps: int = 20, warm: int = 3
) -> list[list[float]]:
    """[block][batch index]: the median time (µs) of one block's call at that batch size
    while `share` workers run it at once, each on its own stream."""
    gpu = workers[0].gpu
    out: list[list[float]] = []
    for b in range(len(gpu.blocks)):
        row = []
        for n in batches:
            x = torch.zeros((n, *gpu.shapes[b]), device=gpu.device)
            times: list[list[int]] = [[] for _ in range(share)]
            gate = threading.Barrier(share)

            def loop(
                k: int,
                x: torch.Tensor = x,
                b: int = b,
                gate: threading.Barrier = gate,
                times: list[list[int]] = times,
            ) -> None:
                gate.wait()
                for i in range(warm + reps):
                    t0 = time.perf_counter_ns()
                    workers[k].run(b, b, x)
                    if i >= warm:
                        times[k].append(time.perf_counter_ns() - t0)

            threads = [threading.Thread(target=loop, args=(k,)) for k in range(share)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            row.append(statistics.median(itertools.chain(*times)) / 1e3)
        out.append(row)
    return out


@dataclass(frozen=True)
class Part:
    """A partition served by GpuStages: blocks first..last, its output tensor's name."""

    first: int
    last: int
    output: str


def _as_fake(part: Part) -> FakePartition:
    """What FakeStages' chains read of a partition: its output's name."""

    def nothing(xs: list[np.ndarray]) -> list[np.ndarray]:
        raise AssertionError("GpuStages runs partitions on the GPU")

    return FakePartition(nothing, (part.output,), lambda n: 0.0)


class GpuStages(FakeStages):
    """The router's stage client over real GPU workers: node -> Worker, model -> Part.
    A first partition takes the image (every request's input handle names it); a last
    one checks its logits against the whole model's (`worst`: the largest difference).

    `emulate` (model -> its profiled µs at batch 1..B): the same workers' threads run no
    GPU work but sleep until the stage's start + that time, as an emulated node does
    (python_onnx_model.py), so that real and emulated differ in nothing else."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        workers: Mapping[str, Worker],
        parts: Mapping[str, Part],
        max_batch: int,
        emulate: Mapping[str, Sequence[float]] | None = None,
    ):
        super().__init__(loop, {m: _as_fake(p) for m, p in parts.items()})
        self.workers = dict(workers)
        self.parts = dict(parts)
        self.emulate = None if emulate is None else {m: list(t) for m, t in emulate.items()}
        gpu = next(iter(self.workers.values())).gpu
        self.gpu = gpu
        self.maps: dict[int, torch.Tensor] = {}  # handle -> a row's feature map (on the GPU)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.images = gpu.image_batch(max_batch)  # every request's input: rows of one image
        x = self.images[:1]
        with torch.no_grad():
            for blk in gpu.blocks:
                x = blk(x)
        self.reference = x[0].clone()  # the whole model's logits, eagerly
        self.worst = 0.0
        self.checked = 0

    async def _timed(
        self, node: str, model: str, xs: list[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], int, int]:
        if node in self.down:
            raise StageUnreachable(f"cannot reach {node}: connection refused")
        part = self.parts[model]
        sent = self.loop.time()
        worker = self.workers[node]
        handles, start_ns, end_ns = await self.loop.run_in_executor(
            worker.pool, self._compute, worker, part, model, xs[0]
        )
        self.calls.append(Call(node, model, len(handles), sent, start_ns / 1e9, end_ns / 1e9))
        return {part.output: handles}, start_ns, end_ns

    def _compute(
        self, worker: Worker, part: Part, model: str, h: np.ndarray
    ) -> tuple[np.ndarray, int, int]:
        start = time.monotonic_ns()
        n = len(h)
        if self.emulate is not None:
            left = start + int(self.emulate[model][n - 1] * 1e3) - time.monotonic_ns()
            if left > 0:
                time.sleep(left / 1e9)
            return np.zeros((n, 1), np.int64), start, time.monotonic_ns()
        x: torch.Tensor | list[torch.Tensor]
        if part.first == 0:
            x = self.images[:n]
        else:
            with self._lock:
                x = [self.maps.pop(int(k)) for k in h.reshape(-1)]
        y = worker.run(part.first, part.last, x)
        end = time.monotonic_ns()  # the stage as a node times it: its checks left out
        if part.last == len(self.gpu.blocks) - 1:  # the model's logits: right ones?
            diff = float((y - self.reference).abs().max())
            self.worst = max(self.worst, diff)
            self.checked += n
            out = np.zeros((n, 1), np.int64)
        else:
            ids = [next(self._ids) for _ in range(n)]
            with self._lock:
                for i, k in enumerate(ids):
                    self.maps[k] = y[i : i + 1]
            out = np.array(ids, np.int64).reshape(n, 1)
        return out, start, end

    async def close(self) -> None:
        self.maps.clear()
