"""Real CNN architectures with seeded random weights, written straight to ONNX.

No model hub is reachable, so the project makes its own models to onboard: a ResNet-50, an
EfficientNet-style network (MBConv: depthwise convolutions and squeeze-excitation) and a
U-Net, whose skip connections make most cuts crossed by several tensors. Every model has a
dynamic batch dimension named ``batch``. Batch norms are folded into the convolutions (as
exporters do for inference), and weights are scaled so that activations stay of order one
through any depth (numerical checks compare outputs relative to their scale).

``width`` scales channel counts and ``image`` the input size, so tests can run small
versions of the same graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from poolpipe.errors import UnknownNameError

OPSET = 17
IR_VERSION = 8  # what every ONNX Runtime of the last years loads


class _Builder:
    """Appends nodes and initializers; names are unique and readable (stage/block/op)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def _init(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
        return name

    def op(self, op_type: str, inputs: list[str], prefix: str, **attrs) -> str:
        name = self._name(prefix)
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        k: int,
        stride: int = 1,
        groups: int = 1,
        act: str | None = "Relu",
        gain: float = 1.0,
        prefix: str = "conv",
    ) -> str:
        fan_in = cin // groups * k * k
        w = self.rng.normal(0.0, gain * np.sqrt(2.0 / fan_in), (cout, cin // groups, k, k))
        b = self.rng.normal(0.0, 0.01, cout)
        name = self._name(prefix)
        wn = self._init(f"{name}.weight", w)
        bn = self._init(f"{name}.bias", b)
        pad = k // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, wn, bn],
                [name],
                name=name,
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[pad, pad, pad, pad],
                group=groups,
            )
        )
        if act == "Relu":
            return self.op("Relu", [name], f"{prefix}_relu")
        if act == "Swish":
            sig = self.op("Sigmoid", [name], f"{prefix}_sig")
            return self.op("Mul", [name, sig], f"{prefix}_swish")
        return name

    def fc(self, x: str, cin: int, cout: int, prefix: str = "fc") -> str:
        w = self.rng.normal(0.0, np.sqrt(1.0 / cin), (cin, cout))
        b = self.rng.normal(0.0, 0.01, cout)
        name = self._name(prefix)
        wn = self._init(f"{name}.weight", w)
        bn = self._init(f"{name}.bias", b)
        self.nodes.append(helper.make_node("Gemm", [x, wn, bn], [name], name=name))
        return name

    def model(
        self, name: str, x: str, outputs: list[tuple[str, list]], image: int
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", 3, image, image])],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, shape) for o, shape in outputs],
            self.inits,
        )
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        m.ir_version = IR_VERSION
        m.producer_name = "poolpipe.offline.zoo"
        m = onnx.shape_inference.infer_shapes(m)
        onnx.checker.check_model(m)
        return m


def _ch(c: int, width: float) -> int:
    return max(4, round(c * width / 4) * 4)


def resnet50(seed: int = 0, width: float = 1.0, image: int = 224, classes: int = 1000):
    b = _Builder(seed)
    x = "input"
    c = _ch(64, width)
    h = b.conv(x, 3, c, 7, stride=2, prefix="stem")
    h = b.op("MaxPool", [h], "stem_pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = c
    for stage, (blocks, mid) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
        mid_c, out_c = _ch(mid, width), _ch(mid * 4, width)
        for i in range(blocks):
            stride = 2 if (i == 0 and stage > 0) else 1
            p = f"layer{stage + 1}.{i}"
            y = b.conv(h, cin, mid_c, 1, prefix=f"{p}.conv1")
            y = b.conv(y, mid_c, mid_c, 3, stride=stride, prefix=f"{p}.conv2")
            # the last conv of a residual branch starts small (zero-init-gamma style)
            y = b.conv(y, mid_c, out_c, 1, act=None, gain=0.2, prefix=f"{p}.conv3")
            if i == 0:
                h = b.conv(h, cin, out_c, 1, stride=stride, act=None, prefix=f"{p}.down")
            h = b.op("Relu", [b.op("Add", [y, h], f"{p}.add")], f"{p}.relu")
            cin = out_c
    h = b.op("GlobalAveragePool", [h], "avgpool")
    h = b.op("Flatten", [h], "flatten", axis=1)
    out = b.fc(h, cin, classes)
    return b.model("resnet50", x, [(out, ["batch", classes])], image)


def efficientnet(seed: int = 0, width: float = 1.0, image: int = 224, classes: int = 1000):
    """EfficientNet-B0's MBConv layout: expansion, depthwise conv, squeeze-excitation."""
    b = _Builder(seed)
    x = "input"
    cin = _ch(32, width)
    h = b.conv(x, 3, cin, 3, stride=2, act="Swish", prefix="stem")
    # (expand ratio, kernel, stride, out channels, repeats)
    stages = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3)]
    stages += [(6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]
    for s, (expand, k, stride, cout, reps) in enumerate(stages):
        cout = _ch(cout, width)
        for i in range(reps):
            p = f"blocks{s}.{i}"
            st = stride if i == 0 else 1
            mid = cin * expand
            y = b.conv(h, cin, mid, 1, act="Swish", prefix=f"{p}.expand") if expand > 1 else h
            y = b.conv(y, mid, mid, k, stride=st, groups=mid, act="Swish", prefix=f"{p}.dw")
            # squeeze-excitation: pool, reduce, expand, gate
            sq = max(1, cin // 4)
            z = b.op("GlobalAveragePool", [y], f"{p}.se_pool")
            z = b.conv(z, mid, sq, 1, act="Swish", prefix=f"{p}.se_reduce")
            z = b.conv(z, sq, mid, 1, act=None, prefix=f"{p}.se_expand")
            y = b.op("Mul", [y, b.op("Sigmoid", [z], f"{p}.se_gate")], f"{p}.se_scale")
            y = b.conv(y, mid, cout, 1, act=None, gain=0.5, prefix=f"{p}.project")
            if st == 1 and cin == cout:
                y = b.op("Add", [y, h], f"{p}.add")
            h, cin = y, cout
    head = _ch(1280, width)
    h = b.conv(h, cin, head, 1, act="Swish", prefix="head")
    h = b.op("Flatten", [b.op("GlobalAveragePool", [h], "avgpool")], "flatten", axis=1)
    out = b.fc(h, head, classes)
    return b.model("efficientnet", x, [(out, ["batch", classes])], image)


def unet(seed: int = 0, width: float = 1.0, image: int = 256, classes: int = 8):
    """U-Net: four encoder levels whose outputs skip over the bottleneck to the decoder, so
    a cut in the middle is crossed by up to five tensors."""
    b = _Builder(seed)
    x = "input"
    chans = [_ch(c, width) for c in (64, 128, 256, 512)]
    skips = []
    h, cin = x, 3
    for lvl, c in enumerate(chans):
        h = b.conv(h, cin, c, 3, prefix=f"enc{lvl}.conv1")
        h = b.conv(h, c, c, 3, prefix=f"enc{lvl}.conv2")
        skips.append((h, c))
        h = b.op("MaxPool", [h], f"enc{lvl}.pool", kernel_shape=[2, 2], strides=[2, 2])
        cin = c
    mid = _ch(1024, width)
    h = b.conv(h, cin, mid, 3, prefix="mid.conv1")
    h = b.conv(h, mid, mid, 3, prefix="mid.conv2")
    cin = mid
    scales = b._init("up.scales", np.array([1.0, 1.0, 2.0, 2.0]))
    for lvl in reversed(range(len(chans))):
        skip, c = skips[lvl]
        up = b.op("Resize", [h, "", scales], f"dec{lvl}.up", mode="nearest")
        up = b.conv(up, cin, c, 1, act=None, prefix=f"dec{lvl}.reduce")
        h = b.op("Concat", [up, skip], f"dec{lvl}.cat", axis=1)
        h = b.conv(h, 2 * c, c, 3, prefix=f"dec{lvl}.conv1")
        h = b.conv(h, c, c, 3, prefix=f"dec{lvl}.conv2")
        cin = c
    out = b.conv(h, cin, classes, 1, act=None, prefix="logits")
    return b.model("unet", x, [(out, ["batch", classes, image, image])], image)


ZOO: dict[str, Callable[..., onnx.ModelProto]] = {
    "resnet50": resnet50,
    "efficientnet": efficientnet,
    "unet": unet,
}


def make_model(
    name: str,
    out: Path,
    *,
    seed: int = 0,
    width: float = 1.0,
    image: int | None = None,
) -> Path:
    """Generate zoo model `name` and write it to `out` (weights inside the file)."""
    if name not in ZOO:
        raise UnknownNameError(f"unknown model {name!r}; choose one of {', '.join(ZOO)}")
    kwargs: dict = {"seed": seed, "width": width}
    if image is not None:
        kwargs["image"] = image
    model = ZOO[name](**kwargs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out)
    return out
