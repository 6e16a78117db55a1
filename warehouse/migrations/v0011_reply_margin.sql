-- What a router measured of the reply's way out in each window: its reply margin less the
-- floor it was started with (ms; the p99 of its door's egress and chains' overhead).
-- `poolpipe plan` and `serve` check a plan's SLOs against a margin of at least the floor
-- plus the latest of these (a plan made for a 3 ms margin, served on a router that
-- measured 5.7-10 ms, refused every request). NULL: rows written before this version.

ALTER TABLE serving_stats ADD COLUMN reply_measured_ms DOUBLE;
