"""The probe's hot loop is hand-optimized (inlined slot scans, pruning by lower bounds, early
exits). Property test: on random pools, servers and busy tables it returns exactly what the
plain rule of dataplane.md returns, computed here with nothing but `earliest_slot` and
`earliest_common_slot` over every candidate, ties included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from poolpipe.scheduler import ReservationScheduler, earliest_common_slot
from tests.factories import make_topology


def reference_probe(sch: ReservationScheduler, pipe, b: int, now: float):
    topo = sch.topo
    server_of = sch.server_of
    t, wait, prev, path = now, 0.0, -1, []
    for d, pid in enumerate(pipe.pools):
        pool = topo.pools[pid]
        lat = pool.latency_us[b]
        nxt = pipe.pools[d + 1] if d + 1 < len(pipe.pools) else None
        out = b * topo.pools[nxt].transfer_in_us if nxt is not None else 0.0

        def send_on(v: int, f: float, out: float = out) -> float:
            return sch.uplink[server_of[v]].earliest_slot(f, out) if out else f

        best = None
        if prev < 0:
            flat, r = sch._flat[pid], sch._rr[pid]
            for i in range(len(flat)):
                v = flat[(r + i) % len(flat)]
                s = sch.vgpu_table[v].earliest_slot(t, lat)
                cand = (send_on(v, s + lat), s)
                if best is None or cand < best[0]:
                    best = (cand, (pid, v, -1, t, t, s, s + lat))
        else:
            dur = b * pool.transfer_in_us
            up = sch.uplink[server_of[prev]]
            groups, r = sch._groups[pid], sch._rr[pid]
            for i in range(len(groups)):
                srv, vgs = groups[(r + i) % len(groups)]
                ts = earliest_common_slot((up, sch.downlink[srv]), t, dur) if dur > 0 else t
                for v in vgs:
                    s = sch.vgpu_table[v].earliest_slot(ts + dur, lat)
                    cand = (send_on(v, s + lat), s + lat)
                    if best is None or cand < best[0]:
                        best = (cand, (pid, v, prev, ts, ts + dur, s, s + lat))
        assert best is not None
        hop = best[1]
        wait += (hop[3] - t) + (hop[5] - hop[4])
        t = hop[6]
        prev = hop[1]
        path.append(hop)
    return wait, t, path


busy = st.lists(
    st.tuples(st.integers(0, 60), st.integers(1, 25)), max_size=5
)  # (start, length) of reservations made before the probe


@settings(max_examples=300, deadline=None)
@given(
    servers=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=2, max_size=3),
    transfer=st.integers(0, 4),
    vgpu_busy=st.lists(busy, min_size=12, max_size=12),
    link_busy=st.lists(busy, min_size=8, max_size=8),
    rr=st.lists(st.integers(0, 11), min_size=3, max_size=3),
    now=st.integers(0, 30),
    b=st.integers(1, 2),
)
def test_probe_equals_the_plain_rule(servers, transfer, vgpu_busy, link_busy, rr, now, b):
    used = sorted({s for on in servers for s in on})  # servers are numbered 0..k-1
    stages = [([used.index(s) for s in on], [7.0, 11.0], float(transfer)) for on in servers]
    sch = ReservationScheduler(make_topology(stages, batch=2))
    key = 0
    for v, table in enumerate(sch.vgpu_table):
        for s, n in vgpu_busy[v]:
            table.reserve(s, s + n, key := key + 1)
    links = sch.uplink + sch.downlink
    for i, table in enumerate(links):
        for s, n in link_busy[i % len(link_busy)]:
            table.reserve(s, s + n // 5 + 1, key := key + 1)
    for pid in range(len(sch._rr)):
        sch._rr[pid] = rr[pid] % len(sch._groups[pid] if pid else sch._flat[pid])
    pipe = sch.topo.pipelines[0]
    got = sch.probe(pipe, b, float(now))
    wait, finish, path = reference_probe(sch, pipe, b, float(now))
    assert (got.wait_us, got.finish_us, got.path) == (wait, finish, path)
    assert got.start_us == path[0][5]  # when the batch starts on its first vGPU
