"""`poolpipe models`: generate zoo models and show where an ONNX model can be cut."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from poolpipe.offline.cuts import METHODS, CutPolicy, prepartition
from poolpipe.offline.onnxgraph import (
    cut_table,
    load_model,
    measure_shapes,
    parse_input_shapes,
    profile_layers,
)
from poolpipe.offline.zoo import ZOO, make_model
from poolpipe_cli.common import add_input_shape_option

console = Console()


def cmd_models_make(args: argparse.Namespace) -> int:
    out = make_model(args.name, Path(args.out), seed=args.seed, width=args.width, image=args.image)
    console.print(f"wrote {args.name} to {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


def cmd_models_cuts(args: argparse.Namespace) -> int:
    path = Path(args.model)
    name = args.name or path.stem
    with console.status(f"{name}: loading and profiling layers with ONNX Runtime (CPU) ..."):
        model = measure_shapes(load_model(path, name, parse_input_shapes(args.input_shape)), name)
        table = cut_table(model, name, profile_layers(model, name, runs=args.runs))
    part = prepartition(
        table,
        args.blocks,
        policy=CutPolicy(args.max_cut_tensors, args.max_cut_bytes),
        method=args.method,
    )
    out = Table(
        title=f"{name}: {len(table.layers)} layers, {args.blocks} blocks ({args.method}), "
        f"cuts crossed by <= {part.policy.max_tensors} tensor(s); balance {part.balance:.2f}",
        title_justify="left",
    )
    for col in ("block", "layers", "first layer", "ms (batch 1, CPU)", "tensors out", "KiB out"):
        out.add_column(col, justify="left" if col == "first layer" else "right")
    for k, ((a, b), us) in enumerate(zip(part.blocks, part.block_us, strict=True)):
        out.add_row(
            str(k),
            f"[{a}, {b})",
            table.layers[a],
            f"{us / 1e3:.3f}",
            str(len(table.crossing[b])),
            f"{table.crossing_bytes[b] / 1024:.1f}",
        )
    console.print(out)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="generate ONNX models and analyse their cuts")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    make = msub.add_parser("make", help=f"generate a model ({', '.join(ZOO)}) as ONNX")
    make.add_argument("name", choices=list(ZOO))
    make.add_argument("out", help="output .onnx file")
    make.add_argument("--seed", type=int, default=0, help="weight seed (0)")
    make.add_argument("--width", type=float, default=1.0, help="channel multiplier (1.0)")
    make.add_argument("--image", type=int, help="input height and width (model default)")
    make.set_defaults(func=cmd_models_make)

    cuts = msub.add_parser("cuts", help="profile layers and pre-partition into blocks")
    cuts.add_argument("model", help="an ONNX file")
    cuts.add_argument("--name", help="model name (default: the file name)")
    cuts.add_argument("--blocks", type=int, default=10)
    cuts.add_argument("--method", choices=METHODS, default=METHODS[0])
    cuts.add_argument(
        "--max-cut-tensors", type=int, default=1, help="tensors per cut, widened if needed (1)"
    )
    cuts.add_argument(
        "--max-cut-bytes", type=float, default=float("inf"), help="bytes per cut at batch 1"
    )
    cuts.add_argument("--runs", type=int, default=5, help="profiled runs per layer (5)")
    add_input_shape_option(cuts)
    cuts.set_defaults(func=cmd_models_cuts)
