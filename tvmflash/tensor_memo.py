"""What is found once per tensor: a model builds its padding mask and position_ids once per
forward and hands the same tensor objects to every layer of a kind, so what they say (row runs,
documents, gather indices, the device syncs for lengths) is found once, not per layer. The memo
is kept on the tensor itself, valid at the tensor's version (an in-place change finds it
anew; a write that bypasses the version counter, through ``.data`` or a numpy or DLPack alias,
is not seen, as autograd does not see it); it must hold no reference back to the tensor (a cycle through a tensor's attributes is
freed only by the garbage collector, and not at all while C++ holds the tensor too)."""

from __future__ import annotations

import torch


def per_tensor(tensor: torch.Tensor, name: str, key, build):
    """``build()``, computed once per tensor, version and ``key`` (kept on the tensor as ``name``)."""
    if tensor.is_inference():  # no version counter to tell an in-place change: computed per call
        return build()
    stamp = (tensor._version, key)
    cached = getattr(tensor, name, None)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    found = build()
    try:
        setattr(tensor, name, (stamp, found))
    except (AttributeError, RuntimeError):  # tensor subclasses that refuse attributes
        pass
    return found


def remembered(tensor: torch.Tensor, name: str, key):
    """What ``per_tensor`` keeps on ``tensor`` as ``name`` for ``key`` at its version, or None
    (nothing is built)."""
    cached = getattr(tensor, name, None)
    return cached[1] if cached is not None and cached[0] == (tensor._version, key) else None
