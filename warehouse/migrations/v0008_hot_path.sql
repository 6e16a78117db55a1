-- The compiled hot path (issue 42): which build of the scheduler, runtime and simulator a
-- scheduler benchmark row was measured on ("compiled (mypyc)" or "pure Python (why)").

ALTER TABLE bench_scheduler ADD COLUMN build VARCHAR;
