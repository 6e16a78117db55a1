"""ONNX side of onboarding: load a model, find its cuts, profile its layers with ONNX Runtime,
and extract blocks as standalone ONNX files with onnx-graphsurgeon.

Every failure is a `ModelError` that names the model and the step.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from poolpipe.errors import ModelError
from poolpipe.offline.cuts import CutTable, crossing_from_lifetimes

BATCH_DIM = "batch"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...]  # first dimension: the batch

    @property
    def feature_map(self) -> bool:
        """A tensor that may cross a cut between stages: floats with the batch first (a
        shape or index tensor, or one whose first dimension is fixed, may not)."""
        return (
            self.dtype.kind == "f" and len(self.shape) >= 1 and not isinstance(self.shape[0], int)
        )

    def bytes_at_batch1(self) -> float:
        dims = [d for d in self.shape[1:] if isinstance(d, int) and d >= 0]
        if len(dims) != len(self.shape) - 1:
            return float("nan")
        return float(math.prod(dims) * self.dtype.itemsize)


def load_model(
    path: Path, name: str | None = None, input_shapes: InputShapes | None = None
) -> onnx.ModelProto:
    """Read and check an ONNX file; Constant nodes become initializers (they never cross).

    `input_shapes` gives inputs' non-batch dimensions (`--input-shape`); every input must
    end with all of them known, else the model is refused naming the input and the option.
    """
    name = name or Path(path).stem
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except FileNotFoundError:
        raise ModelError(f"{name}: load: {path} does not exist") from None
    except Exception as exc:  # protobuf decode errors, checker errors
        raise ModelError(
            f"{name}: load: {path} is not a valid ONNX model ({_first_line(exc)})"
        ) from None
    if not model.graph.node:
        raise ModelError(f"{name}: load: {path} has no nodes")
    _constants_to_initializers(model)
    _set_input_shapes(model, name, input_shapes or {})
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as exc:
        raise ModelError(f"{name}: shape inference failed ({exc})") from None
    return model


# an input's dimensions after the batch, by input name (`--input-shape images=3x320x320`)
InputShapes = dict[str, tuple[int, ...]]


def parse_input_shapes(items: list[str] | tuple[str, ...]) -> InputShapes:
    """'images=3x320x320' (repeatable): the dimensions after the batch, by input name."""
    out: InputShapes = {}
    for item in items:
        key, sep, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x")) if sep and dims else ()
        except ValueError:
            shape = ()
        if not key.strip() or not shape or min(shape) < 1:
            raise ModelError(
                f"--input-shape {item!r}: write NAME=DIMS, the input's dimensions after the "
                "batch as positive integers joined by 'x' (images=3x320x320)"
            )
        out[key.strip()] = shape
    return out


def _dims_text(dims: list) -> str:
    return "x".join(str(d) if isinstance(d, int) else "?" for d in dims) or "(scalar)"


def _set_input_shapes(model: onnx.ModelProto, name: str, shapes: InputShapes) -> None:
    """Give the inputs their dimensions after the batch, and refuse any left unknown."""
    consts = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in consts]
    names = [i.name for i in inputs]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise ModelError(
            f"{name}: --input-shape names {unknown[0]!r}, which is not an input of the model; "
            f"its inputs: {', '.join(names)}"
        )
    for vi in inputs:
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"{name}: load: input {vi.name!r} is not a tensor")
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        given = shapes.get(vi.name)
        if given is not None:
            if tt.HasField("shape") and len(dims) != len(given) + 1:
                raise ModelError(
                    f"{name}: --input-shape {vi.name}={_dims_text(list(given))} gives "
                    f"{len(given)} dimension(s) after the batch, but the input has "
                    f"{max(len(dims) - 1, 0)} ({_dims_text(dims)})"
                )
            for k, d in enumerate(given):
                if k + 1 < len(tt.shape.dim) and dims[k + 1] not in (None, d):
                    raise ModelError(
                        f"{name}: --input-shape {vi.name}={_dims_text(list(given))}: the model "
                        f"fixes dimension {k + 1} at {dims[k + 1]}"
                    )
            batch = tt.shape.dim[0] if tt.shape.dim else None
            batch_dim = onnx.TensorShapeProto.Dimension()
            if batch is not None:
                batch_dim.CopyFrom(batch)
            else:
                batch_dim.dim_param = BATCH_DIM
            del tt.shape.dim[:]
            tt.shape.dim.append(batch_dim)
            for d in given:
                tt.shape.dim.add().dim_value = d
            dims = [None, *given]
        if not tt.HasField("shape") or not dims:
            raise ModelError(
                f"{name}: load: input {vi.name!r} has no batch dimension (its shape is "
                f"{'unknown' if not tt.HasField('shape') else 'a scalar'}); give its "
                f"dimensions after the batch with --input-shape {vi.name}=DIMS"
            )
        if any(d is None or d <= 0 for d in dims[1:]):
            raise ModelError(
                f"{name}: load: input {vi.name!r} has dimensions {_dims_text(dims)} "
                "(? = decided at run time); blocks are cut and profiled at one size, so give "
                f"it with --input-shape {vi.name}={_dims_text([d or 640 for d in dims[1:]])} "
                "(the dimensions after the batch, each ? replaced by the size you serve); "
                "onboard each size you serve as a model of its own"
            )


def measure_shapes(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """The model with every tensor's shape as ONNX Runtime makes it at batch 1 and 2.

    Shape inference cannot follow shapes computed at run time (Shape -> Gather -> Concat ->
    Reshape, as exporters write them), so the model is run once per batch size with every
    tensor as an output: a tensor whose first dimension follows the batch gets the symbolic
    batch there and its other dimensions as measured; one that does not (a shape, an index)
    keeps its measured shape, so no cut is placed across it (`TensorInfo.feature_map`). An
    input with a fixed batch dimension is freed to run at any batch, and refused if the
    model then does not run at batch 2. Outputs must have the batch first: answers are
    split per request along it.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    consts = {t.name for t in g.initializer}
    fixed: dict[str, int] = {}
    for vi in g.input:
        if vi.name in consts:
            continue
        first = vi.type.tensor_type.shape.dim[0]
        if first.HasField("dim_value"):
            fixed[vi.name] = first.dim_value
            first.Clear()
            first.dim_param = BATCH_DIM
    freed = (
        f"input {next(iter(fixed))!r} has a fixed batch dimension of "
        f"{next(iter(fixed.values()))}, and freed of it the model"
        if fixed
        else ""
    )
    probe = onnx.ModelProto()  # the model with every tensor as an output
    probe.CopyFrom(out)
    known = {o.name for o in probe.graph.output}
    tensors = [t for node in g.node for t in node.output if t and t not in consts]
    for t in tensors:
        if t not in known:
            probe.graph.output.append(onnx.ValueInfoProto(name=t))
            known.add(t)
    names = [o.name for o in probe.graph.output]
    sess = _session_or_refuse(probe, f"{name}: load", optimize=False)
    runs: list[dict[str, np.ndarray]] = []
    for batch in (1, 2):
        try:
            values = sess.run(names, random_inputs(probe, batch, seed=batch))
        except Exception as exc:
            if batch == 1:
                raise ModelError(
                    f"{name}: load: the model fails on random inputs at batch 1 "
                    f"({_first_line(exc)})"
                ) from None
            raise ModelError(
                f"{name}: load: {freed or 'the model runs at batch 1 but'} does not run at "
                f"batch 2 ({_first_line(exc)}): something in it fixes the batch size (a "
                "Reshape to a constant shape, say); export it with a dynamic batch axis "
                "(torch.onnx.export(..., dynamic_axes={INPUT: {0: 'batch'}})), since pooled "
                "serving runs requests in batches"
            ) from None
        runs.append(dict(zip(names, values, strict=True)))
    one, two = runs
    shapes: dict[str, list[int | str | None]] = {}
    for t, a in one.items():
        b = two[t]
        if a.ndim >= 1 and a.ndim == b.ndim and 2 * a.shape[0] == b.shape[0] > 0:
            rest: list[int | str | None] = [
                x if x == y else None for x, y in zip(a.shape[1:], b.shape[1:], strict=True)
            ]
            shapes[t] = [BATCH_DIM, *rest]
        else:
            shapes[t] = [int(x) if a.shape == b.shape else None for x in a.shape]
    outputs = {o.name for o in g.output}
    whose = f"{freed}'s " if freed else ""
    for o in g.output:
        shape = shapes[o.name]
        if not shape or shape[0] != BATCH_DIM:
            raise ModelError(
                f"{name}: load: {whose}output {o.name!r} does not have the batch as its first "
                f"dimension (shape {list(one[o.name].shape)} at batch 1, "
                f"{list(two[o.name].shape)} at batch 2); a batch's answers are split per "
                "request along it, so export the model with a dynamic batch axis first in "
                "every input and output"
            )
        o.CopyFrom(_value_info(o.name, one[o.name].dtype, shape))
    del g.value_info[:]
    for t in tensors:
        if t not in outputs:
            g.value_info.append(_value_info(t, one[t].dtype, shapes[t]))
    return out


def _value_info(name: str, dtype: np.dtype, shape: list[int | str | None]) -> onnx.ValueInfoProto:
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return onnx.helper.make_tensor_value_info(name, elem, shape)


_CONSTANT_VALUES = {  # Constant's value attributes other than a tensor, as numpy dtypes
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def _constants_to_initializers(model: onnx.ModelProto) -> None:
    """Constant nodes become initializers, scalars included, so that no cut counts them."""
    g = model.graph
    keep = []
    for node in g.node:
        attr = node.attribute[0] if node.op_type == "Constant" and node.attribute else None
        if attr is not None and attr.name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(attr.t)
        elif attr is not None and attr.name in _CONSTANT_VALUES:
            value = onnx.helper.get_attribute_value(attr)
            t = numpy_helper.from_array(np.asarray(value, dtype=_CONSTANT_VALUES[attr.name]))
        else:  # sparse and string constants stay nodes
            keep.append(node)
            continue
        t.name = node.output[0]
        g.initializer.append(t)
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(keep)


def tensor_infos(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if not tt.elem_type:
            continue
        dims: list[int | str | None] = []
        for d in tt.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        out[vi.name] = TensorInfo(vi.name, dtype, tuple(dims))
    return out


def memory_of(model: onnx.ModelProto) -> tuple[float, float]:
    """The model's weights (its initializers' bytes) and twice its largest tensor of known
    size per sample (an input and an output held at once): what a vGPU's memory must hold
    beside its runtime (poolpipe/domain/memory.py)."""
    weights = 0.0
    for t in model.graph.initializer:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        weights += float(np.prod(t.dims, dtype=float)) * dtype.itemsize
    sizes = [info.bytes_at_batch1() for info in tensor_infos(model).values()]
    largest = max((x for x in sizes if np.isfinite(x)), default=0.0)
    return weights, 2.0 * largest


def node_names(model: onnx.ModelProto) -> list[str]:
    """Node names in graph order, made unique where the file leaves them empty."""
    names = []
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        n = node.name or f"{node.op_type}_{i}"
        if n in seen:
            n = f"{n}_{i}"
        seen.add(n)
        names.append(n)
    return names


def cut_table(
    model: onnx.ModelProto, name: str, latency_us: dict[str, float] | None = None
) -> CutTable:
    """What crosses every cut of `model` (graph order is topological in valid ONNX)."""
    g = model.graph
    consts = {t.name for t in g.initializer}
    infos = tensor_infos(model)
    names = node_names(model)
    n = len(names)
    producer: dict[str, int] = {i.name: -1 for i in g.input if i.name not in consts}
    last_use: dict[str, int] = {}
    for k, node in enumerate(g.node):
        for t in node.input:
            if t and t not in consts:
                if t not in producer:
                    raise ModelError(
                        f"{name}: cut analysis: node {names[k]!r} reads {t!r} before anything "
                        "makes it (the graph is not in topological order)"
                    )
                last_use[t] = k
        for t in node.output:
            if t:
                producer[t] = k
    for o in g.output:
        last_use[o.name] = n
    lifetimes = []
    for t, p in producer.items():
        info = infos.get(t)
        size = info.bytes_at_batch1() if info is not None else float("nan")
        lifetimes.append((t, p, last_use.get(t, p), size))
    crossing, sizes = crossing_from_lifetimes(n, lifetimes)
    lat = latency_us or {}
    return CutTable(
        model=name,
        layers=tuple(names),
        latency_us=tuple(float(lat.get(x, 0.0)) for x in names),
        crossing=crossing,
        crossing_bytes=sizes,
        not_data=tuple(
            tuple(t for t in c if t in infos and not infos[t].feature_map) for c in crossing
        ),
    )


# ---------------------------------------------------------------------------- extraction


def extract_block(model: onnx.ModelProto, table: CutTable, start: int, end: int) -> onnx.ModelProto:
    """Layers [start, end) as a standalone model: inputs are the tensors crossing `start`,
    outputs those crossing `end`, each with the batch dimension kept dynamic."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    tensors = graph.tensors()
    inputs = [tensors[t] for t in table.crossing[start]]
    outputs = [tensors[t] for t in table.crossing[end]]
    infos = tensor_infos(model)
    for t in inputs + outputs:
        info = infos.get(t.name)
        if info is not None:
            t.dtype = info.dtype
            t.shape = [BATCH_DIM, *info.shape[1:]]
    keep = set(table.layers[start:end])
    for node, n in zip(graph.nodes, table.layers, strict=True):
        node.name = n  # the table's names: unique, and made up where the file has none
    graph.nodes = [node for node in graph.nodes if node.name in keep]
    for t in inputs:
        t.inputs.clear()  # cut the tensor off from its producer: it is fed in now
    graph.inputs = inputs
    graph.outputs = outputs
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    block = gs.export_onnx(graph)
    block.ir_version = model.ir_version
    del block.opset_import[:]
    block.opset_import.extend(model.opset_import)
    try:
        onnx.checker.check_model(block)
    except Exception as exc:
        raise ModelError(f"{table.model}: extract block [{start}, {end}) failed ({exc})") from None
    return block


# ---------------------------------------------------------------------------- running


def session(
    model: onnx.ModelProto | Path,
    *,
    threads: int = 1,
    optimize: bool = True,
    profile_prefix: str | None = None,
):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 4 if profile_prefix is not None else 3  # no noise if it fails
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    src = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _session_or_refuse(model: onnx.ModelProto, where: str, **options):
    """An ONNX Runtime session of `model`, or a ModelError saying `where` it cannot run."""
    try:
        return session(model, **options)
    except Exception as exc:
        raise ModelError(
            f"{where}: ONNX Runtime cannot run this model ({_first_line(exc)}); replace the "
            "ops it lacks or register a custom-op library"
        ) from None


def _first_line(exc: BaseException) -> str:
    """The first line of an error's text (ONNX Runtime's and protobuf's run to pages)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def random_inputs(model: onnx.ModelProto, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    consts = {t.name for t in model.graph.initializer}
    infos = tensor_infos(model)
    feeds = {}
    for i in model.graph.input:
        if i.name in consts:
            continue
        info = infos[i.name]
        dims = [batch] + [d if isinstance(d, int) and d > 0 else 1 for d in info.shape[1:]]
        feeds[i.name] = rng.standard_normal(dims).astype(info.dtype)
    return feeds


def profile_layers(
    model: onnx.ModelProto, name: str, *, batch: int = 1, runs: int = 5, threads: int = 1
) -> dict[str, float]:
    """Median latency (µs) of every node, from ONNX Runtime's profiler on the CPU.

    Graph optimizations are off so that every timed kernel is one node of the file (fused
    kernels could not be attributed to layers); block latencies are measured separately on
    the optimized engine.
    """
    with tempfile.TemporaryDirectory() as tmp:
        sess = _session_or_refuse(
            model,
            f"{name}: split (layer profile)",
            threads=threads,
            optimize=False,
            profile_prefix=f"{tmp}/prof",
        )
        feeds = random_inputs(model, batch)
        try:
            for _ in range(runs + 1):
                sess.run(None, feeds)
        except Exception as exc:
            raise ModelError(f"{name}: layer profiling at batch {batch} failed ({exc})") from None
        events = json.loads(Path(sess.end_profiling()).read_text())
    per_node: dict[str, list[float]] = defaultdict(list)
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            per_node[ev["name"][: -len("_kernel_time")]].append(float(ev["dur"]))
    # the first run warms up
    return {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in per_node.items()}
