"""A router killed outright, in a module of its own: what it left is swept only where no
other tritonserver runs since before it was made (sweep_uploads keeps what a live server
may own), and the module servers of test_serving_ops run for their whole module."""

from __future__ import annotations

import subprocess

import pytest

from tests.test_serving import onboarded_tiny, two_partition_plan  # noqa: F401
from tests.test_serving_ops import _killed_outright, _leftovers, _serving

pytestmark = pytest.mark.integration


def test_a_router_killed_outright_leaves_no_triton_behind(onboarded_tiny, tmp_path):  # noqa: F811
    """`kill -9` of `poolpipe serve` used to leave its tritonserver serving 503s, healthy to
    any probe, on the router's ports: every tritonserver it started (its own and its local
    nodes') now goes with it, and a new router gets the same ports."""
    import signal

    from triton_backend.env import free_ports

    wh, _ = onboarded_tiny
    plan_file = tmp_path / "plan.json"
    two_partition_plan().save(plan_file)
    http, grpc = free_ports(2)
    argv = ["--warehouse", wh, "serve", str(plan_file), "--http-port", str(http)]
    argv += ["--grpc-port", str(grpc), "--workspace", str(tmp_path / "ws")]
    before = _leftovers()
    proc = _serving(argv, 180)
    # the router's and its nodes' tritonservers, at least
    left = _killed_outright(proc, at_least=3, within_s=30)
    assert not left, f"processes {left} outlived the router"
    assert _leftovers() - before, "nothing left behind: the sweep below checks nothing"
    again = _serving(argv, 180)  # the same ports: nothing left holds them
    again.send_signal(signal.SIGTERM)
    # (its output read meanwhile: a full pipe would block its stopping steps' log lines)
    try:
        said, _ = again.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        again.kill()
        said, _ = again.communicate()
        why = f"serve did not stop within 120 s of SIGTERM:\n{said[-3000:]}"
        raise AssertionError(why) from None
    assert again.returncode == 0, said[-3000:]
    # what the killed router left, a router or node starting STALE_AFTER_S later sweeps
    import time

    from triton_backend.node.triton import STALE_AFTER_S, sweep_uploads
    from triton_backend.router.door.server import sweep_doors

    later = time.time() + 2 * STALE_AFTER_S
    sweep_uploads(now=later)
    sweep_doors(now=later)
    assert not _leftovers() - before, _leftovers() - before
