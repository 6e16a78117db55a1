"""Transforms of the live application test (imported by the router as
tests.app_transforms:NAME, as a user's package.module:function would be)."""

from __future__ import annotations

import numpy as np

IMAGE = (3, 32, 32)


def as_images(outputs: dict[str, np.ndarray], fanout: int) -> list[np.ndarray]:
    """`fanout` images made from the parent's first output (its logits), each scaled by
    its place: a stand-in for crops a detector's boxes would cut."""
    (logits,) = outputs.values()
    base = np.resize(logits.astype(np.float32).ravel(), IMAGE)
    return [base * (j + 1) for j in range(fanout)]


def wrong_shape(outputs: dict[str, np.ndarray], fanout: int) -> list[np.ndarray]:
    """A transform with a bug: tensors of the wrong shape."""
    return [np.zeros((2, 2), np.float32)] * fanout
