-- Simulation runs, capacity searches and the scheduler benchmark (data-plane issue).

CREATE TABLE sim_runs (
    run_at            TIMESTAMP NOT NULL,
    run_label         VARCHAR NOT NULL,
    config            VARCHAR NOT NULL,      -- free text: group / cluster / plan file
    plan_strategy     VARCHAR NOT NULL,
    cluster           VARCHAR NOT NULL,
    data_plane        VARCHAR NOT NULL,      -- reservation | reactive | eager | deferred
    arrivals          VARCHAR NOT NULL,      -- poisson | gamma:CV | azure:FILE | list:FILE
    load_factor       DOUBLE NOT NULL,
    seed              INTEGER NOT NULL,
    duration_s        DOUBLE NOT NULL,
    jitter            DOUBLE NOT NULL,
    model             VARCHAR NOT NULL,
    rate_per_s        DOUBLE NOT NULL,       -- offered load
    arrived           INTEGER NOT NULL,
    on_time           INTEGER NOT NULL,
    late              INTEGER NOT NULL,      -- completed after the deadline: a miss
    dropped           INTEGER NOT NULL,
    attainment        DOUBLE NOT NULL,       -- on_time / arrived
    latency_p50_us    DOUBLE,
    latency_p99_us    DOUBLE,
    probes_per_batch  DOUBLE,
    sched_us_per_batch DOUBLE,               -- median wall µs of scheduling per batch
    wall_s            DOUBLE NOT NULL,
    host              VARCHAR
);

CREATE TABLE capacity_results (
    run_at            TIMESTAMP NOT NULL,
    run_label         VARCHAR NOT NULL,
    config            VARCHAR NOT NULL,
    plan_strategy     VARCHAR NOT NULL,
    cluster           VARCHAR NOT NULL,
    data_plane        VARCHAR NOT NULL,
    arrivals          VARCHAR NOT NULL,
    search            VARCHAR NOT NULL,      -- step | bisect
    seeds             VARCHAR NOT NULL,
    duration_s        DOUBLE NOT NULL,
    model             VARCHAR NOT NULL,
    capacity          DOUBLE NOT NULL,       -- largest load factor with >= 99% attainment
    points_json       VARCHAR NOT NULL,      -- {load factor: attainment} tried
    simulations       INTEGER NOT NULL,
    host              VARCHAR
);

CREATE TABLE bench_scheduler (
    run_at            TIMESTAMP NOT NULL,
    run_label         VARCHAR NOT NULL,
    config            VARCHAR NOT NULL,
    data_plane        VARCHAR NOT NULL,
    load_factor       DOUBLE NOT NULL,
    vgpus             INTEGER NOT NULL,
    requests          INTEGER NOT NULL,
    batches           INTEGER NOT NULL,
    probes_per_batch  DOUBLE NOT NULL,
    sched_us_median   DOUBLE NOT NULL,
    sched_us_mean     DOUBLE NOT NULL,
    sim_requests_per_wall_s DOUBLE NOT NULL,
    attainment        DOUBLE NOT NULL,
    host              VARCHAR
);
