-- Operating on real hosts (issue 43): requests the router refuses at its door because the
-- plan served cannot serve them (SLO less the reply margin shorter than every pipeline)
-- are an outcome of their own, counted in the per-window statistics.

ALTER TABLE serving_stats ADD COLUMN refused INTEGER NOT NULL DEFAULT 0;
