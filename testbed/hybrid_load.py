"""Hybrid clients as hosts of their own: one process per client class, inside a network
namespace whose NIC carries the class's uplink (testbed.netns EmulatedCluster.add_client),
sending its entry block's feature map to the router's door for its stream at given times.
Each request is "captured" at its time, spends the client's blocks' time on the client
(EMULATED: a wait of the profiled time, the emulated cluster's time scale applied; the
blocks are not run), then goes up the rate-limited link; its end-to-end latency is the
client's time plus the answer's, judged against the stream's SLO.

    ip netns exec NS python -m testbed.hybrid_load SPEC.json OUT.json

SPEC: {"url", "door", "inputs": [[name, dims, dtype], ...], "times_s": [...],
"client_s", "timeout_s"}; OUT: [[captured_s, end_to_end_s, outcome], ...]."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.loadgen import drive


@dataclass(frozen=True)
class ClientClass:
    """One client class: its namespace, the door it sends to, the feature map's tensors
    (name, dims, dtype), when its requests are captured (s from the start), the client's
    blocks' time (s) and the end-to-end SLO (s), both at the emulated time scale."""

    namespace: str
    door: str
    inputs: list[tuple[str, list[int], str]]
    times_s: list[float]
    client_s: float
    slo_s: float


def run_clients(
    url: str, classes: list[ClientClass], workspace: Path, timeout_s: float = 60.0
) -> list[list[tuple[float, float, str]]]:
    """Every class's process started at once in its namespace, waited for: per class, its
    requests (captured s, end-to-end s, outcome)."""
    workspace.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for k, c in enumerate(classes):
            spec, out = workspace / f"client{k}.json", workspace / f"client{k}.out.json"
            doc = {"url": url, "door": c.door, "inputs": c.inputs, "times_s": c.times_s}
            spec.write_text(json.dumps(doc | {"client_s": c.client_s, "timeout_s": timeout_s}))
            cmd = ["ip", "netns", "exec", c.namespace, sys.executable, "-m", "testbed.hybrid_load"]
            with open(workspace / f"client{k}.log", "wb") as log:  # the child keeps its copy
                procs.append(subprocess.Popen([*cmd, str(spec), str(out)], stdout=log, stderr=log))
        for k, proc in enumerate(procs):
            proc.wait(timeout=max(classes[k].times_s, default=0.0) + timeout_s + 60)
    finally:  # every client ended before anything is read or raised: none left running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for k, proc in enumerate(procs):
        out = workspace / f"client{k}.out.json"
        if proc.returncode != 0 or not out.exists():
            tail = (workspace / f"client{k}.log").read_text(errors="replace")[-800:]
            raise RuntimeError(f"client {k} ({classes[k].door}) ended {proc.returncode}: {tail}")
        results.append([tuple(r) for r in json.loads(out.read_text())])
    return results


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    inputs = {n: np.zeros((1, *dims), dtype) for n, dims, dtype in spec["inputs"]}
    client_s = float(spec["client_s"])
    times = np.asarray(spec["times_s"], dtype=float)
    # sent once the client's blocks are done; captured client_s before
    shots = drive(spec["url"], spec["door"], inputs, times + client_s, float(spec["timeout_s"]))
    rows = [[s.sent_s - client_s, client_s + s.latency_s, s.outcome] for s in shots]
    Path(argv[1]).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
