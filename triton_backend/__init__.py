"""Triton adapters, by role: `node/` (stage-worker nodes: tritonserver processes serving
rendered model repositories), `router/` (poolpipe's serving runtime live, behind its own
Triton, the door), `deploy/` (a plan brought up, rolled out and kept serving; the serving
process) and `lb/` (the load balancer in front of a router tier). `env.py` is what every
Triton process here needs."""

# How a batch travels its path (triton_backend.router.transport's HopTransports): through the router
# between stages, or from node to node.
TRANSPORTS = ("router", "chain")
# what a deployment may be asked for: "auto" is "router" when every node is on the router's
# host (loopback addresses), "chain" otherwise (feature maps then never cross the router's NIC)
TRANSPORT_CHOICES = ("auto", *TRANSPORTS)
# the chain transport's extra output: per row, (start, end, sent) ns of each hop of a chain
HOPS_OUTPUT = "POOLPIPE_HOPS"
# each door instance's ring of inputs (router/door/model.py): MB of shared memory
DOOR_RING_MB = 64.0
# Python-backend instances of each served model's door in the router's Triton. With one,
# Triton's dynamic batcher kept a request that came while the door's `execute` ran until
# the next request came or 500 ms passed (it waits for a free instance on a condition that
# the instance's release does not wake: dynamic_batch_scheduler.cc,
# WaitForPayloadSlotAvailable): 5 of 20 warm-up rounds of 4 requests took 0.5 s, and at 40
# req/s on loopback the slowest answer took 48-52 ms against 8-9 ms with two (two runs
# each), unseen by the router (the door stamps when it gets a request). With two, one is
# free unless both run.
ROUTER_INSTANCES = 2
# requests each door's queue in the router's Triton holds at most (more are refused, 503)
DOOR_QUEUE = 1024
REPLAN_GRACE_S = 10.0  # a node out of service this long has the cluster re-planned (serve)
