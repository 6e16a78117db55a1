"""Triton adapters: stage-worker nodes (tritonserver processes serving rendered model
repositories) and the router (a PyTriton model running poolpipe's scheduler live)."""
