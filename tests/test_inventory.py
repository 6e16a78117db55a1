"""Inventories: parsing with errors that name the file and the field, the cluster the
planner sees, which node serves which GPU of a plan, and planning for an inventory."""

from __future__ import annotations

import tomllib

import pytest

from poolpipe.domain.inventory import (
    InventoryError,
    assign,
    load_inventory,
    parse_inventory,
)
from poolpipe.errors import PoolpipeError

GOOD = """
[[servers]]
name = "s0"
bandwidth_gbps = 10
[[servers]]
name = "s1"
bandwidth_gbps = 1
[[nodes]]
name = "b"
server = "s1"
device = "T4"
grpc = "10.0.0.3:8001"
[[nodes]]
name = "a"
server = "s0"
device = "T4"
grpc = "10.0.0.2:8001"
http = "10.0.0.2:8000"
[[nodes]]
name = "c"
server = "s0"
device = "L4"
grpc = "host-c.example:9001"
shares = [1, 2]
[[nodes]]
name = "d"
server = "s0"
device = "T4"
grpc = "10.0.0.2:8011"
"""


def test_an_inventory_gives_the_planner_its_cluster(tmp_path):
    f = tmp_path / "inv.toml"
    f.write_text(GOOD)
    inv = load_inventory(f)
    # GPU i of a type is the i-th node in server order, then as listed
    assert [n.name for n in inv.by_device()["T4"]] == ["a", "d", "b"]
    c = inv.cluster()
    assert c.name == "inv" and c.bandwidth_gbps == 1  # the slowest server's NIC
    assert {p.gpu: (p.count, p.gpus_per_server, p.shares) for p in c.pools} == {
        "L4": (1, 1, (1, 2)),
        "T4": (3, 2, (1,)),
    }
    down = inv.mark_down({"d"})
    assert down.cluster().pool("T4").count == 2
    got = assign({"T4-0": ("T4", 0), "T4-1": ("T4", 1), "L4-0": ("L4", 0)}, down)
    assert {k: v.name for k, v in got.items()} == {"T4-0": "a", "T4-1": "b", "L4-0": "c"}
    with pytest.raises(InventoryError, match=r"T4: needs 3, has 2"):
        assign({"T4-2": ("T4", 2)}, down)
    with pytest.raises(InventoryError, match=r"V100: needs 1, has 0"):
        assign({"V100-0": ("V100", 0)}, inv)
    assert {n.name: n.http for n in inv.nodes if n.http} == {"a": "10.0.0.2:8000"}
    # written out and read back, it is the same inventory
    f2 = tmp_path / "again.toml"
    f2.write_text(inv.to_toml())
    again = load_inventory(f2)
    assert again.nodes == inv.nodes and again.servers == inv.servers


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.replace('grpc = "10.0.0.3:8001"', 'grpc = "10.0.0.3"'),
            r"node b: grpc = '10.0.0.3' is not HOST:PORT",
        ),
        (
            lambda t: t.replace('http = "10.0.0.2:8000"', 'http = "10.0.0.2:80000"'),
            r"node a: http = '10.0.0.2:80000' is not HOST:PORT",
        ),
        (
            lambda t: t.replace('http = "10.0.0.2:8000"', "http = 8000"),
            r"node a: http = 8000 is not a string",
        ),
        (
            lambda t: t.replace('server = "s1"', 'server = "s9"'),
            r"node b: server 's9' is not among",
        ),
        (
            lambda t: t.replace("bandwidth_gbps = 1\n", 'bandwidth_gbps = "fast"\n'),
            r"\[\[servers\]\] #2: bandwidth_gbps = 'fast' is not a float",
        ),
        (lambda t: t.replace('name = "d"', 'name = "a"'), r"node name 'a' is listed twice"),
        (
            lambda t: t.replace('grpc = "10.0.0.2:8011"', 'grpc = "10.0.0.2:8001"'),
            r"two nodes share one gRPC address",
        ),
        (lambda t: t.replace('device = "L4"\n', ""), r"node c has no 'device'"),
        (lambda t: "down = ['zz']\n" + t, r"a node marked down is not listed: 'zz'"),
        (lambda t: t + "\ndown = ['a']\n", r"node d: unknown key\(s\) down"),
        (lambda t: t.replace("[[nodes]]", "[nodes]", 1), r"not valid TOML|nodes must be an array"),
        (
            lambda t: t.replace("shares = [1, 2]", "shares = [0]"),
            r"node c: shares must be integers >= 1",
        ),
    ],
)
def test_a_bad_inventory_names_the_file_and_the_field(tmp_path, edit, message):
    f = tmp_path / "bad.toml"
    f.write_text(edit(GOOD))
    with pytest.raises(InventoryError, match=message) as e:
        load_inventory(f)
    assert str(f) in str(e.value)


def test_missing_or_empty_inventories(tmp_path):
    with pytest.raises(InventoryError, match="inventory file is missing"):
        load_inventory(tmp_path / "none.toml")
    with pytest.raises(InventoryError, match=r"x: no \[\[nodes\]\]"):
        parse_inventory({"servers": [{"name": "s0", "bandwidth_gbps": 1}]}, "x")
    inv = parse_inventory(
        {
            "servers": [{"name": "s0", "bandwidth_gbps": 1}],
            "nodes": [{"name": "n", "server": "s0", "device": "cpu-1t", "grpc": "h:1"}],
            "down": ["n"],
        },
        "y",
    )
    with pytest.raises(InventoryError, match="y: no node left to plan for"):
        inv.cluster()


def test_plan_for_an_inventory(tmp_path, capsys, ppipe_dir):
    """`poolpipe plan --inventory` plans for the inventory's live nodes (real MILP)."""
    from poolpipe.domain.plan import Plan
    from poolpipe_cli import main

    wh = str(tmp_path / "wh.duckdb")
    assert main(["--warehouse", wh, "profiles", "import-ppipe", str(ppipe_dir)]) == 0
    inv = tmp_path / "inv.toml"
    inv.write_text("down = ['d']\n" + GOOD)
    out = tmp_path / "plan.json"
    args = ["--warehouse", wh, "plan", "--models", "repvgg-b3", "--inventory", str(inv)]
    assert main([*args, "--slo-scale", "5", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert {p.gpu: p.count for p in plan.cluster.pools} == {"L4": 1, "T4": 2}
    assert all(n <= {"L4": 1, "T4": 2}[g] for g, n in plan.gpus_used().items())
    assert main([*args, "--cluster", "hc2-large"]) == 2
    assert "not both" in capsys.readouterr().err


def test_the_transport_follows_where_the_nodes_are():
    """auto: through the router when every node is on its host (loopback), else node to
    node; an explicit choice stays; a wrong one is named with the choices."""
    from triton_backend.deploy.deployment import resolve_transport

    local = ["127.0.0.1:8001", "[::1]:8001", "localhost:9000"]
    assert resolve_transport("auto", local) == "router"
    assert resolve_transport("auto", [*local, "10.77.0.2:8001"]) == "chain"
    assert resolve_transport("auto", ["gpu-node-3:8001"]) == "chain"  # a host name
    assert resolve_transport("chain", local) == "chain"
    assert resolve_transport("router", ["10.77.0.2:8001"]) == "router"
    with pytest.raises(PoolpipeError, match="unknown transport 'nccl'; choose auto, router"):
        resolve_transport("nccl", local)


def test_whether_models_may_share_a_gpu_is_the_clusters_and_inventorys_to_say(tmp_path):
    """mixed_model_interference (a latency factor >= 1): in a clusters file, an inventory
    (its cluster, its TOML again) and the warehouse; absent, models keep GPUs of their own;
    a bad one is named with the fix."""
    import tomllib

    from poolpipe.domain.cluster import Cluster, load_clusters
    from poolpipe.errors import ClusterError
    from poolpipe.store.warehouse import Warehouse

    inv = parse_inventory(tomllib.loads("mixed_model_interference = 1.15\n" + GOOD), "inv.toml")
    cluster = inv.cluster()
    assert cluster.mixed_model_interference == 1.15 and cluster.mixes_models
    again = parse_inventory(tomllib.loads(inv.to_toml()), "again.toml")
    assert again.mixed_model_interference == 1.15
    assert not parse_inventory(tomllib.loads(GOOD), "inv.toml").cluster().mixes_models
    with pytest.raises(InventoryError, match="mixed_model_interference = 'yes' is not a number"):
        parse_inventory(tomllib.loads('mixed_model_interference = "yes"\n' + GOOD), "inv.toml")
    path = tmp_path / "clusters.toml"
    path.write_text(
        "[mix]\nbandwidth_gbps = 10\nmixed_model_interference = 1.3\n"
        'gpus = [ { type = "T4", count = 2, shares = [1, 2] } ]\n'
        '[own]\nbandwidth_gbps = 10\ngpus = [ { type = "T4", count = 2 } ]\n'
    )
    clusters = load_clusters(path)
    assert clusters["mix"].mixed_model_interference == 1.3
    assert clusters["own"].mixed_model_interference is None
    assert Cluster.from_dict("mix", clusters["mix"].to_dict()) == clusters["mix"]
    assert (
        clusters["mix"].scaled(4).mixes_models and clusters["mix"].without({"T4": 1}).mixes_models
    )
    with Warehouse.open(tmp_path / "wh.duckdb") as wh:
        wh.store_clusters(list(clusters.values()), "test")
        assert wh.load_cluster("mix") == clusters["mix"]
        assert wh.load_cluster("own").mixed_model_interference is None
    with pytest.raises(ClusterError, match="latency factor >= 1"):
        Cluster.from_dict("bad", {**clusters["mix"].to_dict(), "mixed_model_interference": 0.5})


def test_a_gpus_memory_is_given_or_its_types(tmp_path):
    """memory_gb per GPU type (clusters file, inventory node, warehouse), else the type's
    specification, else unknown; nodes of one device agree."""
    import tomllib

    from poolpipe.domain.cluster import load_clusters
    from poolpipe.store.warehouse import Warehouse

    path = tmp_path / "clusters.toml"
    path.write_text(
        '[c]\nbandwidth_gbps = 10\ngpus = [ { type = "V100", count = 2, memory_gb = 32 },'
        ' { type = "T4", count = 2 }, { type = "X9", count = 1 } ]\n'
    )
    c = load_clusters(path)["c"]
    assert [p.memory for p in c.pools] == [32.0, 16.0, None]
    with Warehouse.open(tmp_path / "wh.duckdb") as wh:
        wh.store_clusters([c], "test")
        assert wh.load_cluster("c") == c
    text = GOOD.replace('device = "L4"\n', 'device = "L4"\nmemory_gb = 48\n')
    inv = parse_inventory(tomllib.loads(text), "inv.toml")
    pools = {p.gpu: p for p in inv.cluster().pools}
    assert pools["L4"].memory == 48.0 and pools["T4"].memory == 16.0
    assert parse_inventory(tomllib.loads(inv.to_toml()), "inv.toml") == inv
    with pytest.raises(InventoryError, match="memory_gb = 0 is not a number > 0"):
        parse_inventory(
            tomllib.loads(GOOD.replace('device = "L4"\n', 'device = "L4"\nmemory_gb = 0\n')),
            "inv.toml",
        )


def test_a_node_joins_and_one_is_released(tmp_path):
    """What a router's inventory becomes when a node joins (`poolpipe join`) or is given back
    (`poolpipe release`): a joining node passes every check a whole inventory's would (its
    server listed or given, its name and address unused, its device's shares alike)."""
    f = tmp_path / "inv.toml"
    f.write_text(GOOD)
    inv = load_inventory(f)
    grown = inv.joined({"name": "e", "server": "s1", "device": "T4", "grpc": "10.0.0.3:8011"})
    assert [n.name for n in grown.by_device()["T4"]] == ["a", "d", "b", "e"]
    assert grown.cluster().pool("T4").count == 4 and inv.cluster().pool("T4").count == 3
    far = inv.joined(
        {"name": "f", "server": "s9", "device": "L4", "grpc": "10.0.9.2:8001", "shares": [1, 2]},
        {"name": "s9", "bandwidth_gbps": 25},
    )
    assert far.cluster().pool("L4").count == 2 and [s.name for s in far.servers][-1] == "s9"
    for node, server, says in (
        ({"name": "a", "server": "s0", "device": "T4", "grpc": "10.0.0.9:1"}, None, "twice"),
        ({"name": "g", "server": "s0", "device": "T4", "grpc": "10.0.0.2:8001"}, None,
         "share one gRPC address"),
        ({"name": "g", "server": "s9", "device": "T4", "grpc": "10.0.0.9:1"}, None,
         "server 's9' is not among"),
        ({"name": "g", "server": "s0", "device": "L4", "grpc": "10.0.0.9:1"}, None,
         "different shares"),
        ({"name": "g", "server": "s0", "device": "T4", "grpc": "nowhere"}, None, "HOST:PORT"),
        ({"name": "g", "server": "s0", "device": "T4"}, None, "grpc"),
    ):  # fmt: skip
        with pytest.raises(InventoryError, match=says):
            inv.joined(node, server)
    fewer = grown.released("b")
    assert [n.name for n in fewer.nodes] == ["a", "c", "d", "e"]
    only = inv.released("b")
    assert [s.name for s in only.servers] == ["s0"]  # s1 held b alone
    assert inv.mark_down({"d"}).released("d").down == frozenset()
    with pytest.raises(InventoryError, match="no node 'z' to release"):
        inv.released("z")


def _servers_of_three(node_per_server: bool) -> str:
    """Three servers of two T4s each: a node per server (gpus = 2) or a node per GPU."""
    text = "".join(f'[[servers]]\nname = "s{k}"\nbandwidth_gbps = 10\n' for k in range(3))
    for k in range(3):
        nodes = [(f"n{k}", 2)] if node_per_server else [(f"n{k}a", 1), (f"n{k}b", 1)]
        for j, (name, gpus) in enumerate(nodes):
            text += (
                f'[[nodes]]\nname = "{name}"\nserver = "s{k}"\ndevice = "T4"\n'
                f'grpc = "10.0.0.{k + 2}:{8001 + 10 * j}"\ngpus = {gpus}\n'
            )
    return text


@pytest.mark.parametrize("node_per_server", [True, False])
def test_a_plans_gpus_are_dealt_over_the_servers_as_its_layout_deals_them(node_per_server):
    # the plan's layout puts GPU i of a type on the type's server i mod servers
    # (scheduler.topology._lay_out), and the router reserves that server's NIC for its
    # transfers: the inventory's GPU i must sit there, not fill the servers one by one
    inv = parse_inventory(tomllib.loads(_servers_of_three(node_per_server)))
    got = assign({f"T4-{i}": ("T4", i) for i in range(6)}, inv)
    assert [got[f"T4-{i}"].node.server for i in range(6)] == ["s0", "s1", "s2"] * 2
    # a server's GPUs in its turns as listed: its first node (or GPU) first
    first = "n0/gpu0" if node_per_server else "n0a"
    second = "n0/gpu1" if node_per_server else "n0b"
    assert (got["T4-0"].name, got["T4-3"].name) == (first, second)
    # a GPU marked down leaves its server's turn to the next server's
    down = inv.mark_down({"n1/gpu0" if node_per_server else "n1a"})
    got = assign({f"T4-{i}": ("T4", i) for i in range(5)}, down)
    assert [got[f"T4-{i}"].node.server for i in range(5)] == ["s0", "s1", "s2", "s0", "s2"]


def _inventory(t4_per_server: tuple[int, ...]) -> str:
    """An L4 server of four GPUs and T4 servers of the given counts, a node per server."""
    counts = (("L4", 4), *(("T4", n) for n in t4_per_server))
    text = ""
    for k, (device, gpus) in enumerate(counts):
        text += (
            f'[[servers]]\nname = "s{k}"\nbandwidth_gbps = 10\n'
            f'[[nodes]]\nname = "n{k}"\nserver = "s{k}"\ndevice = "{device}"\n'
            f'grpc = "10.0.0.{k + 2}:8001"\ngpus = {gpus}\n'
        )
    return text


@pytest.mark.parametrize(
    "t4_per_server, down", [((2,) * 6, None), ((4, 2, 2, 2, 2), None), ((2,) * 6, "n1/gpu0")]
)
def test_the_router_reserves_the_nics_of_the_servers_an_inventory_puts_gpus_on(
    t4_per_server, down, ppipe_profiles
):
    # The layout deals a type's GPU i to its server i mod servers, each as full as the
    # fullest; on servers of different counts (or with a GPU down) the inventory's GPU i
    # may sit elsewhere, and the router's topology takes the inventory's servers (each vGPU
    # on its GPU's server).
    from poolpipe.planner import PlanRequest, make_plan
    from poolpipe.runtime.placement import layout
    from poolpipe.scheduler import build_topology
    from poolpipe.scheduler.topology import on_servers
    from triton_backend.deploy.load import gpu_servers

    inv = parse_inventory(tomllib.loads(_inventory(t4_per_server)))
    inv = inv.mark_down({down}) if down else inv
    group = ("colorization-v2", "googlenet-v3-pytorch", "repvgg-b3")
    plan = make_plan(
        PlanRequest(
            delivery="off",
            models=tuple(ppipe_profiles[n] for n in group),
            weights=(0.30, 0.33, 0.37),
            slos_us=tuple(5 * ppipe_profiles[n].reference_latency_us for n in group),
            cluster=inv.cluster("irregular"),
            strategy="ppipe",
            max_partitions=2,
        )
    )
    topo = build_topology(plan, ppipe_profiles)
    where = gpu_servers(layout(topo), inv)
    got = on_servers(topo, where)
    regular = len(set(t4_per_server)) == 1
    # a first server's GPU down: the others' second GPUs move up a turn
    assert (got is topo) == (regular and not down)
    t4 = [v for v in topo.vgpus if v.gpu == "T4"]
    assert len({v.physical for v in t4}) > 4  # the plan uses GPUs of a third T4 server
    # two vGPUs share a server in the router's topology iff their GPUs share one
    for v in got.vgpus:
        for w in got.vgpus:
            same = where[(v.gpu, v.physical)] == where[(w.gpu, w.physical)]
            assert (v.server == w.server) == same
    assert [s.id for s in got.servers] == list(range(len(got.servers)))
    assert all(got.servers[v.server].gpu == v.gpu for v in got.vgpus)
    if not regular:  # the layout's three T4 servers of four were not where the GPUs are
        assert len({v.server for v in t4}) == 3
        assert len({v.server for v in got.vgpus if v.gpu == "T4"}) > 3
