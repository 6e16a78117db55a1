"""poolpipe: pool-based pipeline-parallel CNN serving on heterogeneous GPU clusters.

The core library (profiles, cluster, plan, planner, warehouse) is pure Python + numpy;
flows, Triton adapters and scripts are thin drivers around it.
"""

__version__ = "0.1.0"

import os as _os

# gRPC's fork handlers off (unless set otherwise) before anything imports gRPC, which reads
# this once: poolpipe's processes fork children (tritonserver, HAProxy) while gRPC threads
# run, and a child forked while another thread was inside gRPC could abort before its exec
# ("epoll_wait error: Bad file descriptor"; HAProxy "exited while starting" once in CI).
# Every child here execs at once, so none needs gRPC's fork support.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from poolpipe import native as _native

# Before any hot-path module is imported: run their sources if the compiled ones are stale.
_native.guard()
