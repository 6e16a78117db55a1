"""GPU memory: what one vGPU of a partition needs, and what a GPU's share gives it.

A vGPU is a process on 1/v of a physical GPU (MPS); its partition's engine holds the
model's weights (all of them: a conservative bound, whatever its blocks), the activations
of a batch (the model's largest tensor in and out, per sample, times the batch) and the
process's own CUDA context and runtime (VGPU_OVERHEAD_GB). It must fit 1/v of the GPU's
memory: shares split the GPU's memory as they split its time. Weights and activations come
from the profile (`ModelProfile.weight_bytes`, `activation_bytes`: from the ONNX model at
onboarding, activations from the layer shapes of a PPipe folder); where the profile does
not know one, it counts for nothing, and the check is the weaker for it.
"""

from __future__ import annotations

from poolpipe.domain.profiles import ModelProfile

GB = 1e9
# The memory of GPU types by their specifications (GB), for clusters and inventories that
# do not give memory_gb; a type not listed is not checked unless given.
DEFAULT_MEMORY_GB: dict[str, float] = {
    "P4": 8.0,
    "T4": 16.0,
    "V100": 16.0,  # (the 32-GB variant: give memory_gb = 32)
    "P100": 16.0,
    "L4": 24.0,
    "A10": 24.0,
    "A10G": 24.0,
    "A30": 24.0,
    "A40": 48.0,
    "L40": 48.0,
    "L40S": 48.0,
    "A100": 40.0,  # (the 80-GB variant: give memory_gb = 80)
    "H100": 80.0,
    "H200": 141.0,
}
# A vGPU process's CUDA context, runtime and engine workspace beyond weights and
# activations (GB).
VGPU_OVERHEAD_GB = 0.5


def vgpu_bytes(profile: ModelProfile, batch: int) -> float:
    """Bytes one vGPU of any partition of `profile` needs at `batch` (module docstring)."""
    weights = profile.weight_bytes or 0.0
    activations = profile.activation_bytes or 0.0
    return weights + batch * activations + VGPU_OVERHEAD_GB * GB


def share_bytes(memory_gb: float | None, share: int) -> float:
    """Bytes a vGPU of 1/`share` of a GPU of `memory_gb` may use (inf: not known)."""
    return float("inf") if memory_gb is None else memory_gb * GB / share


def fits(profile: ModelProfile, memory_gb: float | None, share: int, batch: int) -> bool:
    return vgpu_bytes(profile, batch) <= share_bytes(memory_gb, share)
