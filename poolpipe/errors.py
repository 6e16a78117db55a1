"""Exception hierarchy: every message names the bad input and says how to fix it."""


class PoolpipeError(Exception):
    """Base of every error poolpipe raises on purpose (the CLI prints these without a trace)."""


class ProfileError(PoolpipeError):
    """A profile file or table is malformed; the message names the file and row."""


class ClusterError(PoolpipeError):
    """A cluster description is malformed or unknown."""


class UnknownNameError(PoolpipeError):
    """A model, GPU type, cluster or plan name is not known."""


class InfeasibleError(PoolpipeError):
    """No configuration satisfies the constraints (e.g. a model's SLO is too tight)."""


class SolverError(PoolpipeError):
    """The MILP solver is unavailable, unlicensed, or failed."""


class PlanVerificationError(PoolpipeError):
    """A plan violates a constraint it must satisfy; the message lists the violations."""


class PlanFormatError(PoolpipeError):
    """A plan file or document is not a plan: unreadable, not JSON, a field missing or of
    the wrong type; the message names the file and the field."""


class WarehouseError(PoolpipeError):
    """The warehouse file cannot be used as it is (e.g. wrong schema version)."""


class WarehouseBusyError(WarehouseError):
    """Another process kept the warehouse file locked for longer than we would wait."""


class ModelError(PoolpipeError):
    """An ONNX model cannot be onboarded; the message names the model and the step."""
