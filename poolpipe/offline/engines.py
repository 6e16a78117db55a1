"""Engines that run one block: ONNX Runtime (CPU, or CUDA where present) and TensorRT
(built only where `tensorrt` imports and a GPU is present).

An engine loads a block file into a `Runner`. A runner separates binding (inputs placed where
the engine computes, outputs allocated) from execution, so that a profiler times the
computation and not the copies. Every failure is a `ModelError` naming the model and step.

Device types: each engine names the device class its numbers belong to, which is the
`gpu_type` under which latencies are stored. A CPU is `cpu-<threads>t`, because the same CPU
with another thread count is a different (slower or faster) worker class; a GPU is its
product name without the vendor ("H200", "L4").
"""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from poolpipe.errors import ModelError, PoolpipeError
from poolpipe.offline.anchors import anchored_file

ENGINES = ("onnxruntime", "onnxruntime-cuda", "tensorrt")


@dataclass(frozen=True)
class EngineInfo:
    engine: str  # one of ENGINES
    version: str
    device: str  # device type: the gpu_type of the stored latencies
    device_detail: str  # what the machine says about the device
    threads: int | None = None
    host: str = field(default_factory=platform.node)  # where it was measured

    def provenance(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "engine": self.engine,
            "engine_version": self.version,
            "device": self.device,
            "device_detail": self.device_detail,
            "threads": self.threads,
        }


class Runner(Protocol):
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def bind(self, feeds: dict[str, np.ndarray]) -> None:
        """Place inputs where the engine computes; allocate the outputs."""

    def execute(self) -> None:
        """Run once on the bound inputs and wait until it has finished."""

    def outputs(self) -> list[np.ndarray]:
        """The last execution's outputs, on the host."""


class Engine(Protocol):
    info: EngineInfo

    def build(self, onnx_path: Path, model: str, what: str, max_batch: int) -> Path:
        """Whatever the engine needs made from the ONNX file before it can load it."""

    def load(self, built: Path, model: str, what: str) -> Runner: ...


# ---------------------------------------------------------------------------- devices


@functools.cache
def gpu_name() -> str | None:
    """Product name of GPU 0 ("H200"), or None on a machine without an NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    if not first:
        return None
    words = [w for w in first.split() if w.upper() not in ("NVIDIA", "TESLA", "GEFORCE")]
    # "NVIDIA H200" -> "H200"; "Tesla V100-SXM2-16GB" -> "V100"
    return words[0].split("-")[0] if words else first


@functools.cache
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------- ONNX Runtime


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class OrtRunner:
    """An ONNX Runtime session driven through IO binding (inputs copied to the device once)."""

    def __init__(self, sess: Any, device: str):
        self._sess = sess
        self._device = device  # "cpu" or "cuda"
        self._binding = sess.io_binding()
        self.input_names = tuple(i.name for i in sess.get_inputs())
        self.output_names = tuple(o.name for o in sess.get_outputs())

    def bind(self, feeds: dict[str, np.ndarray]) -> None:
        import onnxruntime as ort

        b = self._sess.io_binding()
        for name in self.input_names:
            b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(feeds[name], self._device))
        for name in self.output_names:
            b.bind_output(name, self._device)
        self._binding = b

    def execute(self) -> None:
        self._sess.run_with_iobinding(self._binding)
        self._binding.synchronize_outputs()

    def outputs(self) -> list[np.ndarray]:
        return list(self._binding.copy_outputs_to_cpu())


class OrtEngine:
    """ONNX Runtime with all graph optimizations: the CPU engine here, CUDA on GPU nodes."""

    def __init__(self, threads: int = 1, cuda: bool = False):
        import onnxruntime as ort

        if threads < 1:
            raise PoolpipeError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.cuda = cuda
        if cuda:
            gpu = gpu_name()
            if gpu is None or "CUDAExecutionProvider" not in ort.get_available_providers():
                raise PoolpipeError(
                    "engine onnxruntime-cuda needs an NVIDIA GPU and the onnxruntime-gpu "
                    f"package (providers here: {', '.join(ort.get_available_providers())}); "
                    "use --engine onnxruntime on this machine"
                )
            self.info = EngineInfo("onnxruntime-cuda", ort.__version__, gpu, gpu, None)
        else:
            self.info = EngineInfo(
                "onnxruntime", ort.__version__, f"cpu-{threads}t", cpu_name(), threads
            )

    def build(self, onnx_path: Path, model: str, what: str, max_batch: int) -> Path:
        # ONNX Runtime compiles at session creation; building checks that it can.
        self._session(onnx_path, model, what)
        return onnx_path

    def _session(self, path: Path, model: str, what: str) -> Any:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # No spinning: idle intra-op threads that busy-wait take the cores from every other
        # process of a shared machine (a stage worker beside the router, other workers).
        # Stage workers run sessions the same way (model_repo_templates/python_onnx_model.py).
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = (
            ["CUDAExecutionProvider", "CPUExecutionProvider"]
            if self.cuda
            else ["CPUExecutionProvider"]
        )
        anchored = None if self.cuda else anchored_file(path)
        src = str(path) if anchored is None else anchored.SerializeToString()
        try:
            return ort.InferenceSession(src, so, providers=providers)
        except Exception as exc:
            raise ModelError(
                f"{model}: build: {self.info.engine} cannot run {what} ({_short(exc)})"
            ) from None

    def load(self, built: Path, model: str, what: str) -> Runner:
        return OrtRunner(self._session(built, model, what), "cuda" if self.cuda else "cpu")


# ---------------------------------------------------------------------------- TensorRT


def tensorrt_available() -> bool:
    """TensorRT builds engines only on an NVIDIA GPU with the `tensorrt` package installed."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return gpu_name() is not None


class TensorRTEngine:
    """TensorRT plans with a dynamic-batch optimization profile, fp16/tf32, a timing cache.

    Runs need PyTorch for device buffers (the practical CUDA allocator on GPU nodes).
    """

    def __init__(
        self, out_dir: Path, fp16: bool = True, tf32: bool = True, workspace_gib: float = 4.0
    ):
        if not tensorrt_available():
            raise PoolpipeError(
                "engine tensorrt needs an NVIDIA GPU and the tensorrt package "
                "(pip install tensorrt); use --engine onnxruntime on this machine"
            )
        import tensorrt as trt

        self._trt = trt
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.out_dir = Path(out_dir)
        self.fp16 = fp16
        self.tf32 = tf32
        self.workspace = int(workspace_gib * (1 << 30))
        gpu = gpu_name() or "gpu"
        self.info = EngineInfo("tensorrt", trt.__version__, gpu, gpu, None)
        self.timing_cache = self.out_dir / f"timing-{gpu}.cache"

    def build(self, onnx_path: Path, model: str, what: str, max_batch: int) -> Path:
        trt = self._trt
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse(Path(onnx_path).read_bytes()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ModelError(f"{model}: build: TensorRT cannot parse {what} ({errors})")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.workspace)
        if self.fp16:
            config.set_flag(trt.BuilderFlag.FP16)
        if self.tf32:
            config.set_flag(trt.BuilderFlag.TF32)
        else:
            config.clear_flag(trt.BuilderFlag.TF32)
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            t = network.get_input(i)
            rest = list(t.shape)[1:]
            opt = max(1, max_batch // 2)
            profile.set_shape(t.name, [1, *rest], [opt, *rest], [max_batch, *rest])
        config.add_optimization_profile(profile)
        cached = self.timing_cache.read_bytes() if self.timing_cache.exists() else b""
        config.set_timing_cache(config.create_timing_cache(cached), ignore_mismatch=False)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise ModelError(f"{model}: build: TensorRT failed to build {what}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        out = self.out_dir / (Path(onnx_path).stem + f".b{max_batch}.plan")
        out.write_bytes(bytes(plan))
        self.timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
        return out

    def load(self, built: Path, model: str, what: str) -> Runner:
        return TensorRTRunner(self._trt, self._logger, built, model, what)


class TensorRTRunner:
    def __init__(self, trt: Any, logger: Any, plan: Path, model: str, what: str):
        import torch

        self._torch = torch
        self._engine = trt.Runtime(logger).deserialize_cuda_engine(plan.read_bytes())
        if self._engine is None:
            raise ModelError(f"{model}: build: TensorRT cannot load the plan of {what}")
        self._ctx = self._engine.create_execution_context()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.input_names = tuple(n for n in names if self._engine.get_tensor_mode(n) == mode)
        self.output_names = tuple(n for n in names if n not in self.input_names)
        self._dtypes = {n: trt.nptype(self._engine.get_tensor_dtype(n)) for n in names}
        self._out: list[Any] = []
        self._keep: list[Any] = []

    def bind(self, feeds: dict[str, np.ndarray]) -> None:
        torch = self._torch
        self._keep = []
        for n in self.input_names:
            t = torch.from_numpy(np.ascontiguousarray(feeds[n], self._dtypes[n])).cuda()
            self._ctx.set_input_shape(n, tuple(t.shape))
            self._ctx.set_tensor_address(n, t.data_ptr())
            self._keep.append(t)
        self._out = []
        for n in self.output_names:
            shape = tuple(self._ctx.get_tensor_shape(n))
            dtype = torch.from_numpy(np.zeros(1, self._dtypes[n])).dtype
            t = torch.empty(shape, dtype=dtype, device="cuda")
            self._ctx.set_tensor_address(n, t.data_ptr())
            self._out.append(t)

    def execute(self) -> None:
        stream = self._torch.cuda.current_stream()
        self._ctx.execute_async_v3(stream.cuda_stream)
        stream.synchronize()

    def outputs(self) -> list[np.ndarray]:
        return [t.cpu().numpy() for t in self._out]


def build_all(
    engine: Engine,
    files: list[Path],
    model: str,
    max_batch: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[Path]:
    """Build every file (block_NN.onnx, whole.onnx) on the engine, in order."""
    built = []
    for k, f in enumerate(files):
        if progress:
            progress("build", k, len(files))
        stem = f.stem
        what = (
            f"block {int(stem[6:])}"
            if stem.startswith("block_") and stem[6:].isdigit()
            else "the whole model"
            if stem == "whole"
            else stem
        )
        built.append(engine.build(f, model, what, max_batch))
    if progress:
        progress("build", len(files), len(files))
    return built


def make_engine(name: str, *, threads: int = 1, out_dir: Path | None = None) -> Engine:
    if name == "onnxruntime":
        return OrtEngine(threads=threads)
    if name == "onnxruntime-cuda":
        return OrtEngine(threads=threads, cuda=True)
    if name == "tensorrt":
        return TensorRTEngine(out_dir or Path("engines"))
    raise PoolpipeError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
