"""poolpipe: pool-based pipeline-parallel CNN serving on heterogeneous GPU clusters.

The core library (profiles, cluster, plan, planner, warehouse) is pure Python + numpy;
flows, Triton adapters and scripts are thin drivers around it.
"""

__version__ = "0.1.0"

from poolpipe import native as _native

# Before any hot-path module is imported: run their sources if the compiled ones are stale.
_native.guard()
