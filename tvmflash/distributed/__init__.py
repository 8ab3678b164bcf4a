"""Context parallelism: exact attention over a sequence sharded across processes (ring attention).

    import torch.distributed as dist
    from tvmflash.distributed import zigzag_ring_flash_attn_func, zigzag_shard, zigzag_unshard

    dist.init_process_group("gloo")                 # CPU tensors; "nccl" for CUDA tensors
    q, k, v = (zigzag_shard(t, dim=1) for t in (q_full, k_full, v_full))   # (B, N/world, H, D)
    out = zigzag_ring_flash_attn_func(q, k, v, causal=True)             # this rank's shard
    out.backward(dout)                                                   # every rank

``ring_flash_attn_func`` takes contiguous shards (rank r: tokens r*n ... (r+1)*n - 1; see
``ring_shard``); ``zigzag_ring_flash_attn_func`` the zigzag ones, which balance causal work.
Both take ``flash_attn_func``'s causal mask, sliding ``window_size`` and ``alibi_slopes`` for the
whole sequence; blocks the mask leaves empty are not computed. Partial results are float32 and
rounded once. How it works: ``tvmflash/distributed/ring.py`` and ``_plan.py``. Example and self-check:
``torchrun --nproc-per-node 4 -m tvmflash.distributed.demo``.
"""

from .ring import ring_flash_attn_func, zigzag_ring_flash_attn_func
from .shard import ring_shard, ring_unshard, zigzag_shard, zigzag_unshard

__all__ = ["ring_flash_attn_func", "ring_shard", "ring_unshard", "zigzag_ring_flash_attn_func", "zigzag_shard",
           "zigzag_unshard"]
