"""Triton adapters: stage-worker nodes (tritonserver processes serving rendered model
repositories) and the router (poolpipe's serving runtime live, behind its own Triton)."""
