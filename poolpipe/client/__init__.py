"""Clients of a running router, for the processes that are not the router: the control
model (rollouts, statistics, the serving plan) over KServe v2 gRPC."""

from poolpipe.client.control import CONTROL_MODEL, send_control

__all__ = ["CONTROL_MODEL", "send_control"]
