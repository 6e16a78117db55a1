-- Pre-partitioning benchmark (offline-pipeline issue): how evenly blocks split a model.

CREATE TABLE bench_prepartition (
    run_at        TIMESTAMP NOT NULL,
    run_label     VARCHAR NOT NULL,
    model         VARCHAR NOT NULL,
    source        VARCHAR NOT NULL,      -- shipped-layers:GPU | onnxruntime-cpu
    layers        INTEGER NOT NULL,
    blocks        INTEGER NOT NULL,
    method        VARCHAR NOT NULL,      -- greedy | balanced
    max_tensors   INTEGER NOT NULL,      -- the cut policy used (tensors crossing a cut)
    balance       DOUBLE NOT NULL,       -- slowest block / fastest block
    shipped_balance DOUBLE,              -- the same for the shipped 10-block table, batch 1
    host          VARCHAR
);
