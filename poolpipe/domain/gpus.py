"""A node that serves several GPUs of its host from one Triton (`poolpipe node --gpus N`).

To the router each of its GPUs is a node of its own: its failure domain, checked, drained,
taken out and brought back alone. A GPU is known by its node's gRPC address and its index,
"HOST:PORT/gpuI" (a node of one GPU by its address alone, as before), and so are the
inventory's names for it ("NODE/gpuI"). Its partition models carry the index
("PARTITION__gpuI"): one Triton model per partition and GPU, an instance per vGPU, placed
on that GPU (instance_group `gpus: [I]` for Triton's GPU backends; the Python backend's
partitions place themselves on the GPU their `poolpipe_gpu` parameter names, so that the
same config loads on a node that emulates the GPU and has none)."""

from __future__ import annotations

SEP = "/gpu"  # between a node's name or address and its GPU's index
MODEL_SEP = "__gpu"  # between a partition's name and the GPU index on a node of several


def gpu_node(node: str, gpu: int | None) -> str:
    """The name (or address) of GPU `gpu` of `node`; `node` itself for a one-GPU node."""
    return node if gpu is None else f"{node}{SEP}{gpu}"


def split_gpu(node: str) -> tuple[str, int | None]:
    """(node name or address, GPU index or None) of what gpu_node made."""
    head, sep, tail = node.rpartition(SEP)
    if sep and tail.isdigit():
        return head, int(tail)
    return node, None


def model_on(model: str, gpu: int | None) -> str:
    """The Triton model name of partition `model` on GPU `gpu` of its node."""
    return model if gpu is None else f"{model}{MODEL_SEP}{gpu}"


def on_node(node: str, model: str) -> tuple[str, str]:
    """(address to call, model name there) of partition `model` on `node` (a gRPC or HTTP
    address, with its GPU where the node has several)."""
    if SEP not in node:
        return node, model
    address, gpu = split_gpu(node)
    return address, model_on(model, gpu)


def model_of(name: str, gpu: int | None) -> str | None:
    """The partition a Triton model `name` serves on GPU `gpu` of its node (None: a model of
    another GPU)."""
    if gpu is None:
        return name
    head, sep, tail = name.rpartition(MODEL_SEP)
    return head if sep and tail == str(gpu) else None
