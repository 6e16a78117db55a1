-- Planner cost objective (planner issue): a price per GPU-hour per GPU type of a cluster,
-- optional (NULL: none given; `poolpipe plan --prices` supplies or overrides it).

ALTER TABLE cluster_pools ADD COLUMN price_per_hour DOUBLE;
