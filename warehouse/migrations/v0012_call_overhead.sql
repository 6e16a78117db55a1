-- What a stage call on the serving nodes took beyond its blocks' profiled run, as the router
-- measured at start-up (ms; a batch of one, the least over the plan's pools): Triton, its
-- Python backend and the transfers around the engine's run. `poolpipe plan` and `serve`
-- add it per partition to a plan's fastest pipeline when they check its SLOs (a classifier
-- profiled at 1.1 ms took 2.5-3.4 ms a call on the 2-core CI machine, and a plan with a
-- 5.2 ms SLO was stored, then served refusing every request). NULL: rows written before
-- this version, or by a router that measured nothing.

ALTER TABLE serving_stats ADD COLUMN call_overhead_ms DOUBLE;
