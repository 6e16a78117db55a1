-- Online serving (online-serving issue): per-minute statistics of the router, pool busy
-- time, rollouts, and the serving benchmarks.

CREATE TABLE serving_stats (
    minute      TIMESTAMP NOT NULL,     -- start of the window
    seconds     DOUBLE NOT NULL,        -- window length
    deployment  VARCHAR NOT NULL,
    plan_id     INTEGER,
    model       VARCHAR NOT NULL,
    arrivals    INTEGER NOT NULL,
    on_time     INTEGER NOT NULL,
    late        INTEGER NOT NULL,
    dropped     INTEGER NOT NULL,
    failed      INTEGER NOT NULL,
    p50_ms      DOUBLE,
    p99_ms      DOUBLE,
    mean_batch  DOUBLE
);

CREATE TABLE serving_pool_busy (
    minute       TIMESTAMP NOT NULL,
    seconds      DOUBLE NOT NULL,
    deployment   VARCHAR NOT NULL,
    plan_id      INTEGER,
    model        VARCHAR NOT NULL,
    pool         INTEGER NOT NULL,
    gpu_type     VARCHAR NOT NULL,
    block_start  INTEGER NOT NULL,
    block_end    INTEGER NOT NULL,
    vgpus        INTEGER NOT NULL,
    busy_ms      DOUBLE NOT NULL
);

CREATE TABLE rollouts (
    rolled_at    TIMESTAMP NOT NULL,
    deployment   VARCHAR NOT NULL,
    plan_from    VARCHAR NOT NULL,
    plan_to      VARCHAR NOT NULL,
    plan_id      INTEGER,
    status       VARCHAR NOT NULL,      -- done | rolled back
    reason       VARCHAR,
    prepare_s    DOUBLE NOT NULL,
    downtime_ms  DOUBLE NOT NULL,
    held         INTEGER NOT NULL,      -- requests that arrived during the switch
    failed       INTEGER NOT NULL       -- requests answered with an error by the switch
);

CREATE TABLE bench_serving (
    run_at      TIMESTAMP NOT NULL,
    run_label   VARCHAR NOT NULL,
    bench       VARCHAR NOT NULL,       -- router-overhead | rollout | live-vs-sim
    config      VARCHAR NOT NULL,
    metric      VARCHAR NOT NULL,
    value       DOUBLE NOT NULL,
    host        VARCHAR
);
