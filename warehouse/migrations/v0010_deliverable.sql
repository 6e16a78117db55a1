-- Plans that state what they deliver (issue 73): per model the req/s a plan serves with
-- >= 99% of requests on time under Poisson arrivals at its throughputs, found by simulating
-- it (poolpipe/sim/deliverable.py), and the plan's objective as delivered (the least of
-- those per weight). NULL: a plan that was not simulated (planned with delivery "off", or
-- stored before this version).

ALTER TABLE plans ADD COLUMN deliverable DOUBLE;
ALTER TABLE plan_models ADD COLUMN deliverable DOUBLE;

-- ./run bench-planner's delivery parts (scripts/bench_delivery.py): per plan and model, its
-- fluid req/s, the deliverable req/s it states, and the same checked by simulations the
-- planner did not make (cost plans: the share of requests on time at `rate`).
CREATE TABLE bench_delivery (
    run_at         TIMESTAMP NOT NULL,
    run_label      VARCHAR NOT NULL,
    config         VARCHAR NOT NULL,     -- e.g. delivery:g2:hc2-small, large:g0:hc1-large
    strategy       VARCHAR NOT NULL,
    packing        VARCHAR NOT NULL,
    model          VARCHAR NOT NULL,
    fluid          DOUBLE NOT NULL,      -- the plan's (fluid) req/s
    stated         DOUBLE,               -- its deliverable req/s as planned
    checked        DOUBLE,               -- the same, checked (cost plans: share on time)
    rate           DOUBLE,               -- cost plans: the rate asked
    cost_per_hour  DOUBLE,
    variant        VARCHAR,              -- the plan chosen (planner/deliverable.py)
    seconds        DOUBLE NOT NULL,      -- planning time
    host           VARCHAR
);

-- Models on GPUs of their own: different models' vGPUs share
-- a physical GPU only where the cluster gives the latency factor their interference costs
-- (NULL: never).
ALTER TABLE clusters ADD COLUMN mixed_model_interference DOUBLE;

-- What a plan's partitions need of a GPU's memory (poolpipe/domain/memory.py): the model's
-- weights and its largest tensor in and out per sample (NULL: not known), and each GPU
-- type's memory where the cluster gives it (NULL: the type's specification, or unchecked).
ALTER TABLE models ADD COLUMN weight_bytes DOUBLE;
ALTER TABLE models ADD COLUMN activation_bytes DOUBLE;
ALTER TABLE cluster_pools ADD COLUMN memory_gb DOUBLE;
