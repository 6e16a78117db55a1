"""A plan brought up and kept serving: its partitions prepared and loaded on nodes, the
deployment and its rollouts, the serving process around it, a router among its peers."""
