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
REPLAN_GRACE_S = 10.0  # a node out of service this long has the cluster re-planned (serve)
