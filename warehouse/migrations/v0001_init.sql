-- v0001_init: profiles, clusters, plans (as rows), solver runs, benchmark results.
CREATE TABLE gpu_types (
    name        VARCHAR PRIMARY KEY,
    description VARCHAR
);

CREATE TABLE models (
    name                  VARCHAR PRIMARY KEY,
    num_blocks            INTEGER NOT NULL CHECK (num_blocks >= 1),
    reference_latency_us  DOUBLE CHECK (reference_latency_us > 0),
    slo_us                DOUBLE CHECK (slo_us > 0),
    source                VARCHAR NOT NULL,
    updated_at            TIMESTAMP NOT NULL
);

CREATE TABLE blocks (
    model        VARCHAR NOT NULL,
    block_index  INTEGER NOT NULL CHECK (block_index >= 0),
    name         VARCHAR,
    onnx_path    VARCHAR,
    PRIMARY KEY (model, block_index)
);

-- Bytes of the feature map leaving block_index (batch 1); one row per internal boundary.
CREATE TABLE block_boundaries (
    model        VARCHAR NOT NULL,
    block_index  INTEGER NOT NULL CHECK (block_index >= 0),
    bytes        DOUBLE NOT NULL CHECK (bytes >= 0),
    PRIMARY KEY (model, block_index)
);

CREATE TABLE block_latency (
    model        VARCHAR NOT NULL,
    block_index  INTEGER NOT NULL CHECK (block_index >= 0),
    gpu_type     VARCHAR NOT NULL,
    share        INTEGER NOT NULL CHECK (share >= 1),
    batch        INTEGER NOT NULL CHECK (batch >= 1),
    latency_us   DOUBLE NOT NULL CHECK (latency_us >= 0),   -- median
    p99_us       DOUBLE CHECK (p99_us >= 0),
    source       VARCHAR NOT NULL,     -- e.g. ppipe-artifact, onnxruntime-profile
    provenance   VARCHAR,              -- JSON: host, device, engine and version, file
    measured_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (model, block_index, gpu_type, share, batch)
);

CREATE TABLE clusters (
    name            VARCHAR PRIMARY KEY,
    bandwidth_gbps  DOUBLE NOT NULL CHECK (bandwidth_gbps > 0),
    source          VARCHAR NOT NULL
);

CREATE TABLE cluster_pools (
    cluster          VARCHAR NOT NULL,
    gpu_type         VARCHAR NOT NULL,
    count            INTEGER NOT NULL CHECK (count >= 0),
    gpus_per_server  INTEGER NOT NULL CHECK (gpus_per_server >= 1),
    shares           INTEGER[] NOT NULL,
    PRIMARY KEY (cluster, gpu_type)
);

CREATE SEQUENCE solver_run_ids START 1;
CREATE TABLE solver_runs (
    run_id         INTEGER PRIMARY KEY DEFAULT nextval('solver_run_ids'),
    started_at     TIMESTAMP NOT NULL,
    solver         VARCHAR NOT NULL,
    status         VARCHAR NOT NULL,
    gap            DOUBLE,
    seconds        DOUBLE NOT NULL,     -- whole planning run
    milp_seconds   DOUBLE NOT NULL,
    num_vars       INTEGER,
    num_integer    INTEGER,
    num_rows       INTEGER,
    candidates     INTEGER,
    feasible_configs INTEGER
);

CREATE SEQUENCE plan_ids START 1;
CREATE TABLE plans (
    plan_id         INTEGER PRIMARY KEY DEFAULT nextval('plan_ids'),
    created_at      TIMESTAMP NOT NULL,
    strategy        VARCHAR NOT NULL,
    packing         VARCHAR NOT NULL,
    cluster         VARCHAR NOT NULL,
    margin          DOUBLE NOT NULL,
    max_partitions  INTEGER NOT NULL,
    objective       DOUBLE NOT NULL,
    solver_run_id   INTEGER,
    label           VARCHAR,
    plan_json       VARCHAR NOT NULL     -- the exact document, for reloading
);

CREATE TABLE plan_models (
    plan_id         INTEGER NOT NULL,
    model           VARCHAR NOT NULL,
    position        INTEGER NOT NULL,
    weight          DOUBLE NOT NULL,
    slo_us          DOUBLE NOT NULL,
    est_throughput  DOUBLE,
    throughput      DOUBLE NOT NULL,
    PRIMARY KEY (plan_id, model)
);

CREATE TABLE plan_pipelines (
    plan_id         INTEGER NOT NULL,
    model           VARCHAR NOT NULL,
    pipeline_index  INTEGER NOT NULL,
    batch           INTEGER NOT NULL,
    latency_us      DOUBLE NOT NULL,
    throughput      DOUBLE NOT NULL,
    PRIMARY KEY (plan_id, model, pipeline_index)
);

CREATE TABLE plan_partitions (
    plan_id          INTEGER NOT NULL,
    model            VARCHAR NOT NULL,
    pipeline_index   INTEGER NOT NULL,
    position         INTEGER NOT NULL,
    block_start      INTEGER NOT NULL,
    block_end        INTEGER NOT NULL,
    gpu_type         VARCHAR NOT NULL,
    share            INTEGER NOT NULL,
    vgpus            INTEGER NOT NULL,
    gpus             DOUBLE NOT NULL,
    latency_us       DOUBLE NOT NULL,
    transfer_us      DOUBLE NOT NULL,
    vgpu_throughput  DOUBLE NOT NULL,
    PRIMARY KEY (plan_id, model, pipeline_index, position)
);

-- One row per (benchmark run, configuration, strategy, model); see scripts/bench_*.py.
CREATE TABLE bench_planner (
    run_at       TIMESTAMP NOT NULL,
    run_label    VARCHAR NOT NULL,
    config       VARCHAR NOT NULL,      -- e.g. main:g3:hc2-large, single:resnet:hc2-large
    strategy     VARCHAR NOT NULL,
    packing      VARCHAR NOT NULL,
    model        VARCHAR NOT NULL,
    objective    DOUBLE NOT NULL,
    throughput   DOUBLE NOT NULL,
    status       VARCHAR NOT NULL,
    gap          DOUBLE,
    seconds      DOUBLE NOT NULL,
    candidates   INTEGER,
    host         VARCHAR
);
