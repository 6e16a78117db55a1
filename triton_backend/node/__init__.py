"""Stage-worker nodes: Triton servers in explicit model-control mode (triton.py), the model
repositories rendered for them (repository.py), and the watch a router keeps on a node's
process (watch.py)."""
