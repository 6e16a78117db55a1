-- Onboarding of ONNX models (offline-pipeline issue): where the blocks came from and where
-- they lie, what each block reads and writes, the whole model's latency beside its blocks',
-- and the onboarding benchmark.

CREATE TABLE model_files (
    model              VARCHAR PRIMARY KEY,
    source_path        VARCHAR NOT NULL,     -- the ONNX file as given
    sha256             VARCHAR NOT NULL,
    blocks_dir         VARCHAR NOT NULL,     -- block_NN.onnx and whole.onnx
    layers             INTEGER NOT NULL,
    method             VARCHAR NOT NULL,     -- pre-partitioning: balanced | greedy
    max_cut_tensors    INTEGER NOT NULL,     -- the cut policy that was used
    balance            DOUBLE NOT NULL,      -- slowest / fastest block in the layer profile
    verify_error_fp32  DOUBLE,               -- blocks in sequence vs whole model, / output scale
    verify_error_fp16  DOUBLE,               -- the same with fp16 boundary feature maps
    onboarded_at       TIMESTAMP NOT NULL
);

ALTER TABLE blocks ADD COLUMN layer_start INTEGER;
ALTER TABLE blocks ADD COLUMN layer_end INTEGER;
ALTER TABLE blocks ADD COLUMN inputs VARCHAR[];
ALTER TABLE blocks ADD COLUMN outputs VARCHAR[];

-- The whole, unsplit model on the same engine, measured beside its blocks.
CREATE TABLE model_latency (
    model        VARCHAR NOT NULL,
    gpu_type     VARCHAR NOT NULL,
    share        INTEGER NOT NULL CHECK (share >= 1),
    batch        INTEGER NOT NULL CHECK (batch >= 1),
    latency_us   DOUBLE NOT NULL CHECK (latency_us >= 0),   -- median
    p99_us       DOUBLE CHECK (p99_us >= 0),
    source       VARCHAR NOT NULL,
    provenance   VARCHAR,
    measured_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (model, gpu_type, share, batch)
);

-- One row per (benchmark run, batch size); step timings repeat on every row of a run.
CREATE TABLE bench_onboard (
    run_at         TIMESTAMP NOT NULL,
    run_label      VARCHAR NOT NULL,
    model          VARCHAR NOT NULL,
    device         VARCHAR NOT NULL,
    blocks         INTEGER NOT NULL,
    total_seconds  DOUBLE NOT NULL,      -- the whole onboarding flow, Prefect included
    split_seconds  DOUBLE,
    build_seconds  DOUBLE,
    verify_seconds DOUBLE,
    profile_seconds DOUBLE,
    store_seconds  DOUBLE,
    batch          INTEGER NOT NULL,
    whole_us       DOUBLE NOT NULL,      -- median latency of the whole model
    blocks_sum_us  DOUBLE NOT NULL,      -- sum of the blocks' median latencies
    ratio          DOUBLE NOT NULL,      -- blocks_sum_us / whole_us
    host           VARCHAR
);
