"""Triton adapters: stage-worker nodes (tritonserver processes serving rendered model
repositories) and the router (poolpipe's serving runtime live, behind its own Triton)."""

# How a batch travels its path (triton_backend.router.TritonExecutor): through the router
# between stages, or from node to node.
TRANSPORTS = ("router", "chain")
# what a deployment may be asked for: "auto" is "router" when every node is on the router's
# host (loopback addresses), "chain" otherwise (feature maps then never cross the router's NIC)
TRANSPORT_CHOICES = ("auto", *TRANSPORTS)
# the chain transport's extra output: per row, (start, end, sent) ns of each hop of a chain
HOPS_OUTPUT = "POOLPIPE_HOPS"
REPLAN_GRACE_S = 10.0  # a node out of service this long has the cluster re-planned (serve)
