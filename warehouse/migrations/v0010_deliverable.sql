-- Plans that state what they deliver (issue 73): per model the req/s a plan serves with
-- >= 99% of requests on time under Poisson arrivals at its throughputs, found by simulating
-- it (poolpipe/sim/deliverable.py), and the plan's objective as delivered (the least of
-- those per weight). NULL: a plan that was not simulated (planned with delivery "off", or
-- stored before this version).

ALTER TABLE plans ADD COLUMN deliverable DOUBLE;
ALTER TABLE plan_models ADD COLUMN deliverable DOUBLE;
