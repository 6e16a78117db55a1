"""Render Triton model repositories for stage-worker nodes from `model_repo_templates/`.

Each partition placed on a node is a config and files (`1/model.onnx`, plus `1/model.py` for
the Python backend that runs ONNX Runtime on CPU nodes), uploaded with the node's load
request (or written as `<repo>/<partition>/...`). Every rendered config is parsed into
Triton's `ModelConfig` protobuf (shipped with tritonclient), so a template error fails here
and not inside a server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf import json_format, text_format
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from poolpipe.errors import PoolpipeError
from poolpipe.offline.anchors import anchored_file
from poolpipe.offline.partitions import PartitionFile, TensorSpec
from triton_backend import HOPS_OUTPUT

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

_CPU = re.compile(r"^cpu-(\d+)t$")


def device_class(device: str) -> tuple[bool, int]:
    """(CPU class?, intra-op threads) of a device type: `cpu-<n>t` runs on n CPU threads;
    any other name is a GPU type (one ONNX Runtime session on the node's GPU; KIND_MODEL)."""
    m = _CPU.match(device)
    return (True, int(m.group(1))) if m else (False, 1)


TEMPLATES = Path(__file__).resolve().parents[2] / "model_repo_templates"
BACKENDS = ("python", "onnxruntime", "tensorrt")


_KSERVE_DTYPES: dict[np.dtype, str] = {}


def kserve_dtype(dtype: np.dtype) -> str:
    """KServe v2 data type name of a numpy dtype ("FP16", ...), as requests carry it."""
    name = _KSERVE_DTYPES.get(dtype)
    if name is not None:
        return name
    from tritonclient.utils import np_to_triton_dtype  # a chain of comparisons: cached

    name = np_to_triton_dtype(np.dtype(dtype))
    if name is None:
        raise PoolpipeError(f"no Triton data type for {dtype}")
    _KSERVE_DTYPES[np.dtype(dtype)] = name
    return name


def triton_dtype(dtype: np.dtype) -> str:
    """Model-config data type of a numpy dtype ("TYPE_FP16", ...)."""
    return "TYPE_" + kserve_dtype(dtype)


@dataclass(frozen=True)
class _T:
    name: str
    triton_dtype: str
    dims: tuple[int, ...]


def _env() -> Environment:
    return Environment(
        loader=FileSystemLoader(TEMPLATES),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render_config(
    part: PartitionFile,
    *,
    backend: str = "python",
    instances: int = 1,
    threads: int = 1,
    max_batch: int = 8,
    cpu: bool = True,
    final_outputs: Sequence[TensorSpec] = (),
    key: str | None = None,
) -> str:
    """`final_outputs`: the whole model's outputs, declared on a partition that is not the
    last so that it may return them (and every partition the hop times) when it forwards
    its feature map along a chain of nodes (python_onnx_model.py); `key`: chains must be
    signed with it (the nodes' key: their model-config API is restricted to it)."""
    if backend not in BACKENDS:
        raise PoolpipeError(f"unknown Triton backend {backend!r}; choose {', '.join(BACKENDS)}")
    text = (
        _env()
        .get_template("config.pbtxt.j2")
        .render(
            name=part_name(part),
            backend=backend,
            max_batch=max_batch,
            inputs=[_T(t.name, triton_dtype(t.dtype), t.dims) for t in part.inputs],
            outputs=[_T(t.name, triton_dtype(t.dtype), t.dims) for t in part.outputs],
            relay_outputs=(
                [
                    _T(t.name, triton_dtype(t.dtype), t.dims)
                    for t in final_outputs
                    if t.name not in {o.name for o in part.outputs}
                ]
                + [_T(HOPS_OUTPUT, "TYPE_INT64", (-1,))]
                if backend == "python"
                else []
            ),
            instances=instances,
            cpu=cpu,
            threads=threads,
            model=part.model,
            start=part.start,
            end=part.end,
            key=key,
        )
    )
    parse_config(text, part_name(part))
    return text


def parse_config(text: str, what: str) -> model_config_pb2.ModelConfig:
    """Triton's own parser: a config it would refuse is refused here."""
    # imported here: the stage and transport modules that use this module's names run on
    # machines without tritonclient too (bench_gpu's `run` on a GPU machine)
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise PoolpipeError(f"rendered config of {what} is not a ModelConfig: {exc}") from None


def part_name(part: PartitionFile) -> str:
    return part.path.stem


def partition_files(
    part: PartitionFile,
    *,
    backend: str = "python",
    instances: int = 1,
    threads: int = 1,
    max_batch: int = 8,
    cpu: bool = True,
    final_outputs: Sequence[TensorSpec] = (),
    key: str | None = None,
    latency_us: Sequence[float] = (),
    device: str = "",
) -> tuple[str, dict[str, bytes]]:
    """One partition model as a node loads it: its config (config.pbtxt text) and its
    files by path inside the model's folder ("1/model.onnx", ...). `latency_us`: its
    profiled latency on `device` at batch 1, 2, ... (GPU device types): shipped as
    1/emulation.json, what a node that emulates the device completes batches by."""
    text = render_config(
        part,
        backend=backend,
        instances=instances,
        threads=threads,
        max_batch=max_batch,
        cpu=cpu,
        final_outputs=final_outputs,
        key=key,
    )
    if backend == "tensorrt":
        raise PoolpipeError(
            "tensorrt_plan partitions need engines built on the GPU node (poolpipe.offline.engines."
            "TensorRTEngine); render them there"
        )
    # CPU stage workers run ONNX Runtime with layout anchors, as the profiler does
    files = {"1/model.onnx": node_onnx(part) if backend == "python" else part.path.read_bytes()}
    if backend == "python":
        files["1/model.py"] = (TEMPLATES / "python_onnx_model.py").read_bytes()
    if len(latency_us):
        files["1/emulation.json"] = json.dumps(
            {"device": device, "latency_us": [float(x) for x in latency_us]}
        ).encode()
    return text, files


def node_onnx_path(part: PartitionFile) -> Path:
    """Where write_node_onnx keeps the ONNX file a CPU node runs for `part`."""
    return part.path.with_name(part.path.stem + ".node.onnx")


def write_node_onnx(part: PartitionFile) -> None:
    """The ONNX file a CPU stage worker runs (with layout anchors), beside the partition's
    (a hard link to it when it needs none). Made where the partition is cut, in a process
    of its own during a rollout: reading a model to anchor it holds the GIL (0.21 s for a
    100 MB ResNet-50 here), which stalled the serving router once per node loaded."""
    anchored = anchored_file(part.path)
    path = node_onnx_path(part)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    if anchored is None:
        try:
            os.link(part.path, tmp)
        except OSError:  # no hard links here
            tmp.write_bytes(part.path.read_bytes())
    else:
        tmp.write_bytes(anchored.SerializeToString())
    tmp.replace(path)


def node_onnx(part: PartitionFile) -> bytes:
    """The bytes of the file a CPU node runs: write_node_onnx's when it is at least as new
    as the partition's, else made here."""
    path = node_onnx_path(part)
    with contextlib.suppress(OSError):
        if path.stat().st_mtime_ns >= part.path.stat().st_mtime_ns:
            return path.read_bytes()
    anchored = anchored_file(part.path)
    return anchored.SerializeToString() if anchored is not None else part.path.read_bytes()


def upload_config(text: str, what: str) -> str:
    """A config.pbtxt as the JSON the model repository API's load request carries."""
    return json_format.MessageToJson(parse_config(text, what), preserving_proto_field_name=True)


def render_partition(
    part: PartitionFile,
    repo: Path,
    *,
    backend: str = "python",
    instances: int = 1,
    threads: int = 1,
    max_batch: int = 8,
    cpu: bool = True,
) -> Path:
    """Write one partition model into repository `repo`; returns its folder."""
    text, files = partition_files(
        part, backend=backend, instances=instances, threads=threads, max_batch=max_batch, cpu=cpu
    )
    folder = Path(repo) / part_name(part)
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(text)
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
    return folder
