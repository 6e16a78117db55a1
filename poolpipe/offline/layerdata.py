"""The shipped layer-level data (`ppipe-gpu/layers/<model>/`) as cut tables, so that the
pre-partitioner can be run on real GPU layer timings and compared with the shipped blocks."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from poolpipe.errors import ProfileError
from poolpipe.offline.cuts import CutTable


def layer_cut_table(layers_dir: Path, model: str, gpu: str) -> CutTable:
    d = Path(layers_dir) / model
    lat_file = d / f"layer-latency-{gpu}.csv"
    try:
        with lat_file.open() as f:
            rows = list(csv.reader(f))
        cuts = json.loads((d / "cuts.json").read_text())
        shapes = json.loads((d / "shapes.json").read_text())
    except FileNotFoundError as exc:
        raise ProfileError(f"{model}: missing layer data file {exc.filename}") from None
    names, lats = [], []
    for k, row in enumerate(rows[1:], start=2):
        try:
            names.append(row[0])
            lats.append(float(row[1]))
        except (IndexError, ValueError):
            raise ProfileError(f"{lat_file}: row {k} is not 'node,latency': {row}") from None
    if cuts and cuts[-1]["node"] == "$output$":
        cuts = cuts[:-1]  # nothing crosses after the model's end
    if len(cuts) != len(names) + 1 or cuts[0]["node"] != "$input$":
        raise ProfileError(
            f"{d / 'cuts.json'}: expected '$input$' and then one entry per layer of {lat_file.name}"
            f" ({len(names)}), found {len(cuts)} entries"
        )

    def size(t: str) -> float:
        s = shapes.get(t)
        if s is None:
            return float("nan")
        return float(np.prod(s["shape"][1:], dtype=float) * np.dtype(s["dtype"]).itemsize)

    # cuts.json lists the cut after every layer; position N (after the last) is the output
    crossing = tuple(tuple(c["cut"]) for c in cuts)
    return CutTable(
        model=model,
        layers=tuple(names),
        latency_us=tuple(lats),
        crossing=crossing,
        crossing_bytes=tuple(sum(size(t) for t in c) for c in crossing),
    )
