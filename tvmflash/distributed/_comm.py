"""Ring communication and the up-front agreement of all ranks on the problem.

``Ring`` sends one buffer to the next rank and receives one from the previous rank with
``torch.distributed.batch_isend_irecv`` (gloo for CPU tensors, NCCL for CUDA tensors: the same
calls). ``start`` returns at once; ``wait`` blocks until both transfers finished, so compute
issued between the two overlaps the transfer.

Failure behaviour: every wait is bounded by the process group's timeout (the ``timeout`` given
to ``init_process_group``; PyTorch's default is 30 minutes for gloo, 10 for NCCL). A peer that
died is usually noticed at once (its sockets close); a peer that raised but lives on is noticed
when the timeout expires. Either way the error raised names this rank, the peer, the step and
what was being exchanged. After such an error the process group is out of step and should be
destroyed.
"""

from __future__ import annotations

import hashlib
import struct
import time

import torch
import torch.distributed as dist


def resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tvmflash ring attention needs torch.distributed: call "
                           "torch.distributed.init_process_group first")
    return dist.group.WORLD if group is None else group


def group_timeout(group, device: torch.device) -> str:
    try:  # private API; only used to make error messages more helpful
        return f"{group._get_backend(device).options._timeout.total_seconds():g} s"
    except Exception:  # noqa: BLE001
        return "the timeout given to init_process_group"


class RingError(RuntimeError):
    """A ring transfer failed or timed out (a peer rank failed or is stuck)."""


class Ring:
    """Send to rank + 1, receive from rank - 1 (ranks of ``group``)."""

    def __init__(self, group, device: torch.device, phase: str):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next_rank = (self.rank + 1) % self.world
        self.prev_rank = (self.rank - 1) % self.world
        self._send_to = dist.get_global_rank(group, self.next_rank)
        self._recv_from = dist.get_global_rank(group, self.prev_rank)
        self.device = device
        self.phase = phase
        self.bytes_sent = 0  # per call, for the benchmarks and tests
        self.messages = 0
        self.wait_s = 0.0  # time blocked in wait(): transfers the compute did not hide

    def start(self, send: torch.Tensor, recv: torch.Tensor, what: str, step: int, tag: int = 0):
        """Post send(``send`` -> next) and recv(``recv`` <- previous); returns a handle for ``wait``.

        Transfers of different kinds in flight together (the backward's K/V blocks and dK/dV
        sums) get different tags (gloo matches on them; NCCL keeps the order of posting, which
        every rank shares)."""
        ops = [dist.P2POp(dist.isend, send, self._send_to, self.group, tag),
               dist.P2POp(dist.irecv, recv, self._recv_from, self.group, tag)]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as err:  # noqa: BLE001 - re-raised with the context
            raise self._error(what, step, err) from err
        self.bytes_sent += send.numel() * send.element_size()
        self.messages += 1
        return works, what, step

    def wait(self, handle) -> None:
        works, what, step = handle
        start = time.perf_counter()
        try:
            for work in works:
                work.wait()
        except Exception as err:  # noqa: BLE001 - re-raised with the context
            raise self._error(what, step, err) from err
        self.wait_s += time.perf_counter() - start

    def _error(self, what: str, step: int, err: Exception) -> RingError:
        return RingError(
            f"tvmflash ring attention ({self.phase}, step {step + 1} of {self.world}): rank {self.rank} "
            f"exchanging {what} (sending to rank {self.next_rank}, receiving from rank {self.prev_rank}) "
            f"failed: a peer rank failed or is stuck (every wait is bounded by the process group's "
            f"timeout, {group_timeout(self.group, self.device)}). Cause: {err}")


# ----------------------------------------------------------------------------------------------
# Up-front agreement: every rank describes its call; one all_gather; every rank checks all rows.

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_FIELDS = ("batch", "seqlen", "heads", "head_dim", "k batch", "k seqlen", "k heads", "k head_dim", "dtype", "causal",
           "layout", "softmax_scale", "deterministic", "window_size left", "window_size right", "alibi_slopes")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def slopes_digest(slopes) -> int:
    """0 without ALiBi, else a 56-bit digest of the slopes' shape and values (ranks compare it)."""
    if slopes is None:
        return 0
    data = repr(tuple(slopes.shape)).encode() + slopes.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return 1 + int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _describe(q, k, v, softmax_scale, causal, layout, deterministic, window, slopes) -> list[int]:
    # v's shape equals k's (checked on each rank before)
    return [*q.shape, *k.shape, _DTYPE_CODES.get(q.dtype, 0), int(causal),
            layout, _float_bits(softmax_scale), int(deterministic), *window, slopes_digest(slopes)]


def _readable(field: str, value: int):
    if field == "dtype":
        return {code: str(dt).removeprefix("torch.") for dt, code in _DTYPE_CODES.items()}.get(value, "?")
    if field == "softmax_scale":
        return struct.unpack("<d", struct.pack("<q", value))[0]
    if field == "causal" or field == "deterministic":
        return bool(value)
    if field == "layout":
        return ("contiguous", "zigzag")[value]
    if field == "alibi_slopes":
        return "None" if value == 0 else f"slopes with digest {value:x}"
    return value


def agree(group, q, k, v, softmax_scale, causal, layout: int, deterministic: bool, local_error: Exception | None,
          device: torch.device, window=(-1, -1), slopes=None) -> None:
    """One all_gather of each rank's (shapes, dtype, causal, layout, scale, window, ALiBi slopes)
    and whether its own checks passed. Raises on every rank, the same moment, if any rank's checks failed or the ranks
    disagree; so a bad call never leaves the others waiting in the ring."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    row = [0] * (1 + len(_FIELDS))
    if local_error is None:
        row = [1, *_describe(q, k, v, softmax_scale, causal, layout, deterministic, window, slopes)]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(rows, mine, group=group)
    except Exception as err:  # noqa: BLE001 - re-raised with the context
        raise RingError(
            f"tvmflash ring attention: rank {rank} could not agree on the inputs with the other {world - 1} "
            f"ranks: a peer rank failed or is stuck (bounded by the process group's timeout, "
            f"{group_timeout(group, device)}). Cause: {err}") from err
    if local_error is not None:
        raise local_error
    table = [r.tolist() for r in rows]
    failed = [i for i, r in enumerate(table) if r[0] != 1]
    if failed:
        raise ValueError(f"tvmflash ring attention: rank(s) {failed} rejected their inputs (see their error); "
                         f"every rank stops")
    for i, r in enumerate(table):
        for field, ours, theirs in zip(_FIELDS, table[rank][1:], r[1:]):
            if ours != theirs:
                raise ValueError(
                    f"tvmflash ring attention: ranks disagree on {field}: rank {rank} has "
                    f"{_readable(field, ours)}, rank {i} has {_readable(field, theirs)} (every rank must "
                    f"pass equally shaped shards, the same dtype, causal, softmax_scale, layout, window_size and "
                    f"alibi_slopes; q shapes "
                    f"{[tuple(x[1:5]) for x in table]}, k shapes {[tuple(x[5:9]) for x in table]})")
