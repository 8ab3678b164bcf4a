"""Cutting a full sequence into the ranks' shards and putting the shards back together.

``ring_shard``/``ring_unshard``: rank r holds tokens r*n ... (r+1)*n - 1 (for
``ring_flash_attn_func``). ``zigzag_shard``/``zigzag_unshard``: the sequence is cut into 2*world
chunks and rank r holds chunks r and 2*world-1-r (for ``zigzag_ring_flash_attn_func``; balances
causal work). ``*_shard`` takes the full tensor (present on every rank, e.g. the token ids) and
returns this rank's shard, a copy for zigzag and a view for ring; ``*_unshard`` all-gathers the
shards (a collective: every rank calls it) into the full tensor, without autograd history. The
unshard helpers materialise the whole sequence, so they are for inputs/outputs and tests, not for
activations that only fit sharded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._comm import resolve_group


def zigzag_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two chunks (of 2*world) rank ``rank`` holds, in order."""
    return rank, 2 * world - 1 - rank


def _rank_world(group):
    group = resolve_group(group)
    return group, dist.get_rank(group), dist.get_world_size(group)


def _check_divisible(x: torch.Tensor, dim: int, parts: int, what: str) -> None:
    if x.shape[dim] % parts:
        raise ValueError(f"{what}: dimension {dim} has {x.shape[dim]} entries, which is no multiple of {parts}")


def zigzag_shard(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    group, rank, world = _rank_world(group)
    _check_divisible(x, dim, 2 * world, f"zigzag_shard over {world} ranks cuts the sequence into {2 * world} chunks")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(rank, world)], dim)


def _gather(x: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return parts


def zigzag_unshard(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    group, _, world = _rank_world(group)
    _check_divisible(x, dim, 2, "zigzag_unshard: a zigzag shard holds two equal chunks")
    ordered = [None] * (2 * world)
    for rank, part in enumerate(_gather(x, group, world)):
        first, second = part.chunk(2, dim)
        a, b = zigzag_chunks(rank, world)
        ordered[a], ordered[b] = first, second
    return torch.cat(ordered, dim)


def ring_shard(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    group, rank, world = _rank_world(group)
    _check_divisible(x, dim, world, f"ring_shard over {world} ranks")
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n)


def ring_unshard(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    group, _, world = _rank_world(group)
    return torch.cat(_gather(x, group, world), dim)
