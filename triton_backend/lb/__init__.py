"""The load balancer in front of a router tier (HAProxy)."""
