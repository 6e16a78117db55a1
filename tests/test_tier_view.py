"""Who drives which node when routers of a tier go and come back (pure: shard_assignment,
TierView, partition owners)."""

from __future__ import annotations

import pytest

from poolpipe.domain.tier import InventoryRouter, TierView, shard_assignment
from triton_backend.deploy.deployment import generation_tag, owned_by

DEVICES = {"a": "L4", "b": "T4", "c": "L4", "d": "T4", "e": "T4", "f": "T4"}


def _routers() -> tuple[InventoryRouter, ...]:
    def r(name: str, nodes: str) -> InventoryRouter:
        k = int(name[1])
        return InventoryRouter(name, f"h:{k}1", f"h:{k}2", f"h:{k}3", 1, tuple(nodes))

    return (r("r0", "ab"), r("r1", "cde"), r("r2", "f"))


def test_every_router_live_drives_its_own_shard():
    assert shard_assignment(_routers(), DEVICES, {"r0", "r1", "r2"}) == {
        "r0": ("a", "b"),
        "r1": ("c", "d", "e"),
        "r2": ("f",),
    }


def test_a_gone_routers_nodes_are_dealt_out_type_by_type_each_node_once():
    out = shard_assignment(_routers(), DEVICES, {"r0", "r2"})
    # r1's L4 goes to r2 (no L4 yet), its T4s one to each
    assert out == {"r0": ("a", "b", "d"), "r2": ("f", "c", "e")}
    every = [n for nodes in out.values() for n in nodes]
    assert sorted(every) == sorted(DEVICES)  # each node driven, by one router


@pytest.mark.parametrize("live", [{"r0"}, {"r1"}, {"r2"}])
def test_one_router_left_drives_every_node(live):
    out = shard_assignment(_routers(), DEVICES, live)
    assert sorted(out[next(iter(live))]) == sorted(DEVICES)


def test_no_router_live_drives_nothing():
    assert shard_assignment(_routers(), DEVICES, set()) == {}


def test_a_peer_is_gone_after_its_silence_and_one_never_seen_after_the_start_grace():
    view = TierView("r0", ["r1", "r2"], gone_after_s=3.0, start_grace_s=30.0, now=0.0)
    view.saw("r1", True, 1.0)
    view.saw("r2", False, 1.0)
    assert view.live(3.9) == {"r0", "r1", "r2"}  # r2 never seen: within the start grace
    assert view.live(4.0) == {"r0", "r2"}  # r1 silent for 3 s
    view.saw("r1", True, 5.0)  # back
    assert view.live(6.0) == {"r0", "r1", "r2"}
    view.saw("r1", True, 29.0)
    assert view.live(30.0) == {"r0", "r1"}


def test_partition_names_carry_their_router():
    assert owned_by(f"tiny__b00-04__{generation_tag('r-1', 3)}") == "r-1"
    assert owned_by(f"tiny__b00-04__{generation_tag(None, 3)}") is None
    assert owned_by("tiny__b00-04__r0-gx") is None
