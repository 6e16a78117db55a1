-- The bytes of one request's inputs as a client sends them (a row of each input tensor):
-- what crosses the first server's NIC per request, counted by the planner where asked
-- (PlanRequest.count_inputs, poolpipe plan --count-inputs). NULL: not known (profiles
-- imported without the artifact's layers/<model>/ files, onboarded ONNX models).

ALTER TABLE models ADD COLUMN input_bytes DOUBLE;
