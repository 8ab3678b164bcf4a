"""Kernel objects users call, and ``load``: TVM's runtime alone (no compiler, no torch).

CPU libraries load with TVM's runtime library alone (``libraries.load_library``), not through
``import tvm``: a process whose kernels are all in the disk cache never imports TVM's Python
package (``compiler``'s warm starts).

``FlashKernels`` wraps a compiled module with its metadata (``meta``: target, spec, configs,
tuning records) and launches it: it checks the arguments (``checks.py``), plans the work
(``plan.py``: sequence tables, backward rounds, thread count) and calls the kernels, which write
their outputs in place. CPU and CUDA modules differ in what they launch; the call signatures
are the same.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tvm_ffi

from . import cache, checks, cuda_binaries, plan, settings, threads
from .config import AMX, BF16_DOT, config_from_json
from .libraries import load_library

if TYPE_CHECKING:
    import tvm

CPU_FUNCTIONS = ("flash_fwd", "flash_bwd", "uniform_means", "uniform_grads")
CUDA_FUNCTIONS = ("flash_fwd", "flash_bwd_prep", "flash_bwd", "flash_bwd_dq")


def functions_of(meta: dict) -> tuple[str, ...]:
    return CUDA_FUNCTIONS if meta["target"]["kind"] == "cuda" else CPU_FUNCTIONS


# --- fork safety ---------------------------------------------------------------------------------
# TVM's CPU thread pool is thread-local, created at a thread's first parallel launch. fork() copies
# it into the child without its worker threads: the next launch from the thread that forked waits
# for them forever. In a forked child that thread's launches therefore run on a helper thread,
# whose pool TVM creates anew (every other thread of a child is new, and so is its pool).
_forked_thread: int | None = None
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _forked_thread, _helper, _helper_lock
    _forked_thread, _helper, _helper_lock = threading.get_ident(), None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _on_helper_thread(function, args):
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tvmflash-after-fork")
        helper = _helper
    return helper.submit(function, *args).result()


def fork_safe(function):
    """A compiled CPU function that also runs in a forked child (results are the same: the
    kernels do not depend on which thread launches them)."""
    def call(*args):
        if threading.get_ident() == _forked_thread:
            return _on_helper_thread(function, args)
        return function(*args)

    return call


class FlashKernels:
    """Compiled fused forward and backward kernels for one target, head dim, dtype and spec.

    ``forward`` and ``backward`` take any DLPack tensors (torch, numpy, tvm) in the flash-attn
    layout ``(batch, seqlen, heads, head_dim)`` and write their outputs in place; ``lse`` is
    ``(batch, heads, seqlen_q)`` float32. Sizes are free (any batch, lengths, heads with
    ``heads % heads_k == 0``); strided views are read in place, only the head dim must be
    contiguous. Packed sequences (varlen): pass ``(1, total, heads, head_dim)`` tensors, lse
    ``(1, heads, total)``, and ``cu_seqlens_q``/``cu_seqlens_k``.
    """

    def __init__(self, module, meta: dict, source_text: str | None = None, library: Path | None = None,
                 causal: bool = False, loaded_as: Path | None = None):
        self._module = module
        self._library = library  # the shared library this module was loaded from, if any
        self._loaded_as = loaded_as or library  # the name dlopen knows it by (cache.store)
        self.meta = meta
        self.target_kind = meta["target"]["kind"]
        self.is_cuda = self.target_kind == "cuda"
        spec = meta["spec"]
        self.head_dim, self.dtype, self.out_dtype = spec["head_dim"], spec["dtype"], spec["out_dtype"]
        # Kernels take the mask at run time: ``causal`` is only the default of the calls.
        self.causal = causal
        self.deterministic = bool(meta.get("deterministic", False))
        self.tuning_record = meta.get("tuning_record")
        self._source = source_text
        self._mod_inputs = [tuple(i) for i in meta.get("mod_inputs", [])]
        # parallel loops on torch's OpenMP threads when torch is here (threads.py, which handles
        # fork itself); TVM's own pool needs fork_safe
        self._on_torch_threads = not self.is_cuda and threads.route(self._loaded_as)
        tvm_pool = not self.is_cuda and not self._on_torch_threads
        from .target import other_architecture

        if not self.is_cuda and other_architecture(meta["target"]):
            # kernels cross-compiled for another architecture (aarch64 on x86, ...): their code can
            # be inspected, not loaded (TVM's JIT refuses it); calls are refused by _check_runs_here
            self._functions = {}
        else:
            self._functions = {name: fork_safe(module[name]) if tvm_pool else module[name]
                               for name in functions_of(meta)}

    def with_causal(self, causal: bool) -> FlashKernels:
        """The same module with another default mask."""
        if causal == self.causal:
            return self
        return FlashKernels(self._module, self.meta, self._source, self._library, causal, self._loaded_as)

    def plan_threads(self, num_threads: int | None = None) -> int:
        """The slot count a call plans for: ``num_threads``, else torch's intra-op thread count
        for kernels on torch's threads, else tvmflash's (``settings.num_threads``)."""
        if num_threads is None and self._on_torch_threads:
            return threads.torch_threads()
        return _threads(num_threads)

    # parsed on demand: loading prebuilt kernels must work without TVM's compiler library
    @property
    def target(self) -> tvm.target.Target:
        import tvm

        return tvm.target.Target(self.meta["target"])

    @functools.cached_property
    def configs(self) -> dict:
        return {kernel: config_from_json(cfg) for kernel, cfg in self.meta["configs"].items()}

    def __repr__(self):
        mask = "causal" if self.causal else "full"
        extra = ", deterministic" if self.deterministic else ""
        from .target import key

        return f"FlashKernels({key(self.meta['target'])}, head_dim={self.head_dim}, {self.dtype}, {mask}{extra})"

    @functools.cached_property
    def _missing_features(self) -> list[str]:
        """The instruction-set extensions these CPU kernels need and this CPU lacks (kernels
        compiled here for another CPU, e.g. to inspect their code): the ones their products
        need, and every extension they were compiled for (for any CPU model, this one's too)."""
        from .target import AMX_BF16_FEATURES, bf16_dot_features, missing_for_cpu_kernels, missing_isa_features

        # (CUDA configs have no products: they need no CPU feature)
        products = {getattr(cfg, "products", None) for cfg in self.configs.values()}
        needed = {*(bf16_dot_features(self.meta["target"]) if BF16_DOT in products else ()),
                  *(AMX_BF16_FEATURES if AMX in products else ())}
        missing = missing_isa_features(sorted(needed)) if needed else []
        return sorted({*missing, *missing_for_cpu_kernels(self.meta["target"], self.meta.get("isa_features", []))})

    @functools.cached_property
    def _tiles_refused(self) -> bool:
        """Whether these are AMX kernels and Linux refused this process the tile registers (asked
        once per process: amx.request_tile_permission)."""
        if not any(getattr(cfg, "products", None) == AMX for cfg in self.configs.values()):
            return False
        from .amx import request_tile_permission

        return not request_tile_permission()

    def _check_runs_here(self) -> None:
        if self._missing_features:
            raise RuntimeError(f"these kernels were compiled for {self.meta['target'].get('mcpu')} and use "
                               f"instructions this CPU lacks ({', '.join(self._missing_features)}): they would crash "
                               "here; compile them for this CPU (target \"llvm\") to run them")
        if self._tiles_refused:
            raise RuntimeError("these kernels multiply on AMX tiles, which Linux refused this process (see the "
                               "warning above): compile them with products other than 'amx' to run them here")

    # --- planning ------------------------------------------------------------------------------
    def _window(self, causal, window_size) -> tuple[int, int]:
        causal = self.causal if causal is None else checks.require_bool("causal", causal)
        return checks.window(window_size, causal)

    def _sequences(self, kernel: str, batch: int, seqlen_q: int, seqlen_k: int, heads_k: int, cu_seqlens_q,
                   cu_seqlens_k, diagonal=None, like=None, row_runs=None):
        """plan.py's sequence table and tile maps, as tensors where the kernels run (``like``'s
        device for CUDA kernels). ``row_runs``: a tuple of (row, start, end) of batched tensors:
        a sequence of positions start..end - 1 of that batch row, queries and keys alike (a padded
        batch read in place, documents packed into rows; CPU kernels)."""
        cfg = self.configs[kernel]
        device = _device_of(like) if self.is_cuda else None
        if row_runs is not None:
            if self.is_cuda or seqlen_q != seqlen_k or cu_seqlens_q is not None:
                raise ValueError("row runs take CPU kernels and batched tensors with as many queries as keys")
            if any(not (0 <= row < batch and 0 <= start <= end <= seqlen_q) for row, start, end in row_runs):
                raise ValueError(f"row runs must lie within the {batch} rows of {seqlen_q} positions, got {row_runs}")
            return _row_runs_arrays_cached(tuple(row_runs), cfg.block_q, cfg.block_k, heads_k)
        if cu_seqlens_q is None and cu_seqlens_k is None:
            return _batched_arrays(batch, seqlen_q, seqlen_k, cfg.block_q, cfg.block_k, heads_k, diagonal, device)
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k go together")
        if batch != 1:
            raise ValueError(f"packed (varlen) tensors have batch 1 (1, total, heads, head_dim), got batch {batch}")
        q_device = checks.info(like, "q").device
        cu_q = checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, seqlen_q, device=q_device)
        cu_k = checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, seqlen_k, batch=len(cu_q) - 1, device=q_device)
        key = None if device is None else (device.dlpack_device_type(), device.index)
        return _varlen_arrays_cached(tuple(cu_q), tuple(cu_k), cfg.block_q, cfg.block_k, heads_k, key)

    def _mods(self, q, mod_inputs, mod_grads=None, block_mask=None) -> list:
        """The mod inputs (and gradients) the kernels take, then the block mask's tensors, each
        checked to be on q's device."""
        extra = [*mod_inputs, *(mod_grads or ()), *(block_mask or ())]
        if extra:
            checks.check_devices(checks.info(q, "q").device, {f"mod input / block mask tensor {i}": t
                                                              for i, t in enumerate(extra)})
        if len(mod_inputs) != len(self._mod_inputs):
            names = [i[0] for i in self._mod_inputs]
            raise ValueError(f"these kernels read {len(names)} mod inputs {names}, got {len(mod_inputs)}")
        args = list(mod_inputs)
        if mod_grads is not None:
            wanted = [i for i in self._mod_inputs if i[3]]
            if len(mod_grads) != len(wanted):
                raise ValueError(f"the backward writes {len(wanted)} mod-input gradients, got {len(mod_grads)}")
            args += list(mod_grads)
        return args + list(block_mask or ())

    # --- launches --------------------------------------------------------------------------------
    def forward(self, q, k, v, out, lse, softmax_scale: float | None = None, *, causal: bool | None = None,
                window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None, mod_inputs=(), block_mask=None,
                diagonal: int | None = None, num_threads: int | None = None) -> None:
        """out, lse = attention(q, k, v). ``causal``/``window_size``: flash-attn's masks (causal
        defaults to the one given to ``compile``). ``mod_inputs``, ``block_mask``: for kernels
        compiled with score/mask mods or block sparsity (``tvmflash.flex_attention`` passes
        them). ``diagonal``: the key query 0 is aligned with (default bottom-right,
        ``seqlen_k - seqlen_q``). ``num_threads``: the plan's thread count (results do not
        depend on it)."""
        dims = checks.check_forward_args(self, q, k, v, out, lse)
        scale = checks.softmax_scale(softmax_scale, self.head_dim)
        self.launch_forward(dims, q, k, v, out, lse, scale, self._window(causal, window_size), cu_seqlens_q,
                            cu_seqlens_k, self._mods(q, mod_inputs, block_mask=block_mask), diagonal, num_threads)

    def launch_forward(self, dims, q, k, v, out, lse, scale: float, window: tuple[int, int], cu_seqlens_q,
                       cu_seqlens_k, mods: list, diagonal=None, num_threads=None, row_runs=None) -> None:
        """``forward`` on checked arguments: ``dims`` = ``checks.check_forward_args(...)``, scale
        and window final (the torch op checks its inputs once and allocates out and lse itself).
        ``row_runs``: see ``_sequences`` (rows outside the runs are not written)."""
        batch, seqlen_q, heads, heads_k = dims
        self._check_runs_here()
        left, right = window
        seqs, tables = self._sequences("forward", batch, seqlen_q, _len(k), heads_k, cu_seqlens_q, cu_seqlens_k,
                                       diagonal, like=q, row_runs=row_runs)
        if self.is_cuda:
            checks.check_cuda_grid(heads)
            self._functions["flash_fwd"](q, k, v, out, lse, scale, left, right, tables[0], tables[1], *mods)
            return
        n_threads = self.plan_threads(num_threads)
        if self._on_torch_threads:  # no more threads than tasks (query or key tiles x heads)
            threads.limit(min(n_threads, max(seqs.query_tiles * heads, seqs.key_tiles * heads_k)))
        self._functions["flash_fwd"](q, k, v, out, lse, scale, left, right, n_threads, *tables[:3], *mods)

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float | None = None, *,
                 causal: bool | None = None, window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
                 mod_inputs=(), mod_grads=(), block_mask=None, diagonal: int | None = None,
                 num_threads: int | None = None) -> None:
        """dq, dk, dv of the forward with the same arguments; ``out`` and ``lse`` are the
        forward's. ``mod_grads``: fp32 buffers (flattened) receiving the gradients of the mod
        inputs that require one (the CPU kernels write them, the CUDA kernels add into them:
        pass zeros)."""
        dims = checks.check_backward_args(self, dout, q, k, v, out, lse, dq, dk, dv)
        self.launch_backward(dims, dout, q, k, v, out, lse, dq, dk, dv, checks.softmax_scale(softmax_scale, self.head_dim),
                             self._window(causal, window_size), cu_seqlens_q, cu_seqlens_k, mod_inputs, mod_grads,
                             block_mask, diagonal, num_threads)

    def launch_backward(self, dims, dout, q, k, v, out, lse, dq, dk, dv, scale: float, window: tuple[int, int],
                        cu_seqlens_q, cu_seqlens_k, mod_inputs=(), mod_grads=(), block_mask=None, diagonal=None,
                        num_threads=None, row_runs=None) -> None:
        """``backward`` on checked arguments: ``dims`` = ``checks.check_backward_args(...)`` or,
        where the caller allocated dq, dk, dv itself, ``checks.check_backward_inputs(...)``.
        ``row_runs``: see ``_sequences`` (gradient rows outside the runs are not written)."""
        batch, seqlen_q, heads, heads_k = dims
        self._check_runs_here()
        left, right = window
        seqs, tables = self._sequences("backward", batch, seqlen_q, _len(k), heads_k, cu_seqlens_q, cu_seqlens_k,
                                       diagonal, like=q, row_runs=row_runs)
        if self.is_cuda:  # (the CPU kernels check the LSE themselves)
            checks.check_lse_recomputable(lse)
            self._cuda_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, (left, right), seqs, tables[0],
                                self._mods(q, mod_inputs, mod_grads, block_mask), heads_k,
                                packed=cu_seqlens_q is not None)
            return
        n_threads = self.plan_threads(num_threads)
        if self._on_torch_threads:
            threads.limit(n_threads)
        self._functions["flash_bwd"](dout, q, k, v, out, lse, dq, dk, dv, scale, left, right, n_threads,
                                     seqs.rounds, seqs.super_tile, *tables,
                                     *self._mods(q, mod_inputs, mod_grads, block_mask[:1] if block_mask else None))

    # --- rows whose softmax is uniform (transformers' eager where the mask hides every key) -------------
    def add_uniform_means(self, out_span, v, weight) -> bool:
        """``out_span += weight * mean(v over its keys)`` per query head (``uniform_rows.add_means``)
        in one kernel (``kernels/uniform_rows.py``); ``weight`` (batch, rows, ...) float32 0/1.
        False where these kernels have no such function (CUDA) or refuse the arguments (then
        nothing was written)."""
        return self._uniform("uniform_means", v, v, out_span, weight.view(v.shape[0], -1), 1.0 / v.shape[1])

    def add_uniform_grads(self, dq, dk, dv, q, k, v, dout_span, first: int, weight, scale: float) -> bool:
        """dq, dk, dv += the uniform rows' gradients (``uniform_rows.add_gradients`` without
        softcap), rows ``first ..`` of q and dq: one kernel, sums in fp32, each gradient rounded
        once. False as for ``add_uniform_means``."""
        n = k.shape[1]
        return self._uniform("uniform_grads", k, q, k, v, dout_span, weight.view(k.shape[0], -1), dq, dk, dv, first,
                             scale / n, 1.0 / n)

    def _uniform(self, name: str, kv, *args) -> bool:
        function = self._functions.get(name)
        if function is None:
            return False
        self._check_runs_here()
        if self._on_torch_threads:  # (one task per (batch row, kv head))
            threads.limit(min(self.plan_threads(), kv.shape[0] * kv.shape[2]))
        try:  # (the generated function's argument checks run before it writes anything)
            function(*args)
        except (ValueError, TypeError):
            return False
        return True

    def workspace_bytes(self, kernel: str, batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int,
                        num_threads: int | None = None) -> int:
        """Scratch memory one call of ``kernel`` ("forward" or "backward") allocates, in bytes.

        CPU: the fp32 packed copies and accumulators (a few copies of q and k, independent of
        the thread count) plus each thread's tile buffers. CUDA: the fp32 row statistics and dQ
        accumulator(s) of the backward.
        """
        if kernel not in ("forward", "backward"):
            raise ValueError(f"kernel must be 'forward' or 'backward', got {kernel!r}")
        batch, seqlen_q, seqlen_k = (checks.count(n, x) for n, x in (("batch", batch), ("seqlen_q", seqlen_q),
                                                                    ("seqlen_k", seqlen_k)))
        heads, heads_k = checks.count("heads", heads, 1), checks.count("heads_k", heads_k, 1)
        if heads % heads_k:
            raise ValueError(f"heads ({heads}) must be a multiple of heads_k ({heads_k})")
        threads = _threads(num_threads)
        if self.is_cuda:
            if kernel == "forward":
                return 0
            rows = cuda_stats_rows(seqlen_q)
            partials = (deterministic_splits(batch, heads_k, -(-seqlen_k // self.configs["backward"].block_k))
                        if self.deterministic else 1)
            return 4 * (batch * heads * 3 * rows + partials * batch * seqlen_q * heads * self.head_dim)
        cfg = self.configs[kernel]
        seqs = plan.batched(batch, seqlen_q, seqlen_k, block_q=cfg.block_q, block_k=cfg.block_k, heads_k=heads_k)
        sizes = dict(heads=heads, heads_k=heads_k, head_dim=self.head_dim, block_q=cfg.block_q, block_k=cfg.block_k,
                     threads=threads, products=cfg.products)
        if kernel == "forward":
            return plan.forward_workspace_bytes(seqs, **sizes)
        grad_elements = max(sum(math.prod(i[1]) for i in self._mod_inputs if i[3]), 1)
        return plan.backward_workspace_bytes(seqs, grad_input_elements=grad_elements, **sizes)

    # --- CUDA --------------------------------------------------------------------------------
    def _cuda_backward(self, dout, q, k, v, out, lse, dq, dk, dv, scale, window, seqs, table, mods, heads_k,
                       packed: bool) -> None:
        # FlashAttention-2's three launches (kernels/cuda.py): row statistics + zeroed fp32 dQ
        # accumulator, the fused backward, the dQ conversion. Workspace: O(N) fp32.
        checks.check_cuda_grid(seqs.count * heads_k)
        batch, seqlen_q, heads, _ = (int(n) for n in q.shape)
        key_tiles = seqs.max_key_tiles  # per sequence: a block per key tile (atomic), or splits
        if self.deterministic:
            splits = partials = deterministic_splits(seqs.count, heads_k, key_tiles)
        else:
            splits, partials = key_tiles, 1
        stats = _workspace(dq, (batch, heads, 3, cuda_stats_rows(seqlen_q, packed)))
        dq_acc = _workspace(dq, (partials, batch, seqlen_q, heads, self.head_dim))
        self._functions["flash_bwd_prep"](dout, out, lse, stats, dq_acc)
        self._functions["flash_bwd"](dout, q, k, v, stats, dq_acc, dk, dv, scale, splits, *window, table, *mods)
        self._functions["flash_bwd_dq"](dq_acc, dq, scale)

    # --- export --------------------------------------------------------------------------------
    def export_library(self, path: str | os.PathLike) -> None:
        """Write the compiled module (a shared library) and its metadata (``path + '.json'``)."""
        # CPU kernels take the mask per call: the export records this object's default
        _export(self._module, self._library, self._source, {**self.meta, "causal": self.causal}, path)

    def source(self) -> str:
        """The generated code: LLVM IR for CPU targets, CUDA C for CUDA targets."""
        if self._source is None:
            raise RuntimeError("this module was loaded from a library without its source; "
                               "compile it with tvmflash.compile(...) to see the generated code")
        return self._source

    def assembly(self) -> str:
        """The machine code of CPU kernels compiled in this process, as assembly."""
        if self.is_cuda or self._library is not None or not hasattr(self._module, "mod"):
            raise RuntimeError("assembly is kept for CPU kernels compiled in this process only: compile with "
                               "tvmflash.compile(..., cache=False)")
        return self._module.mod.inspect_source("asm")


def _export(module, library: Path | None, source: str | None, meta: dict, path: str | os.PathLike) -> None:
    """Write a compiled module's shared library to ``path`` and its metadata, with the library's
    checksum, to ``path + '.json'`` (what ``load`` and ``$TVMFLASH_PREBUILT`` read)."""
    path = Path(path)
    # (each file renamed into place, private whatever the umask: cache.replace_with)
    if library is not None:  # loaded from a library: its code is that file
        if not (path.exists() and path.samefile(library)):  # (exported over itself: the metadata only)
            cache.replace_with(path, lambda temporary: shutil.copyfile(library, temporary))
    else:
        cache.replace_with(path, lambda temporary: cache.export(module, temporary, source))
    text = json.dumps({**meta, "sha256": cache.file_digest(path)}, indent=1)
    cache.replace_with(Path(str(path) + ".json"), lambda temporary: temporary.write_text(text))


def _len(k) -> int:
    return int(k.shape[1])


def _threads(num_threads) -> int:
    if num_threads is None:
        return settings.num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")
    return num_threads


@functools.lru_cache(maxsize=256)
def _batched_arrays_cached(batch, seqlen_q, seqlen_k, block_q, block_k, heads_k, diagonal, device_key):
    seqs = plan.batched(batch, seqlen_q, seqlen_k, block_q=block_q, block_k=block_k, heads_k=heads_k,
                        diagonal=diagonal)
    return seqs, _tables(seqs, device_key)


@functools.lru_cache(maxsize=256)
def _varlen_arrays_cached(cu_q: tuple, cu_k: tuple, block_q, block_k, heads_k, device_key):
    """The sequence tables of packed sequences (cached by their boundaries: a model's layers,
    and the forward and backward of each, call with the same ones; the plan and the copies into
    TVM tensors took ~130 us of a 4-sequence call's ~400)."""
    seqs = plan.varlen(cu_q, cu_k, block_q=block_q, block_k=block_k, heads_k=heads_k)
    return seqs, _tables(seqs, device_key)


@functools.lru_cache(maxsize=256)
def _row_runs_arrays_cached(row_runs: tuple, block_q, block_k, heads_k):
    rows, starts, ends = zip(*row_runs) if row_runs else ((), (), ())
    lengths = [end - start for start, end in zip(starts, ends)]
    seqs = plan.sequences(starts, lengths, starts, lengths, packed=False, block_q=block_q, block_k=block_k,
                          heads_k=heads_k, rows=rows)
    return seqs, _tables(seqs, None)


def _tables(seqs: plan.Sequences, device_key) -> list:
    """A plan's tables as kernel arguments: on the CPU (``device_key`` None) the arrays in place,
    64-byte aligned as TVM's allocator aligns them; elsewhere copied to the device by TVM."""
    if device_key is None:
        return [tvm_ffi.from_dlpack(_aligned(a)) for a in seqs.arrays()]
    import tvm

    return [tvm.runtime.tensor(a, tvm.runtime.Device(*device_key)) for a in seqs.arrays()]


def _aligned(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of a numpy array whose data starts on a 64-byte boundary."""
    raw = np.empty(a.nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _batched_arrays(batch, seqlen_q, seqlen_k, block_q, block_k, heads_k, diagonal, device=None):
    """The sequence tables of a batched call (cached: they depend on sizes only), on ``device``
    (None: the CPU)."""
    key = None if device is None else (device.dlpack_device_type(), device.index)
    return _batched_arrays_cached(batch, seqlen_q, seqlen_k, block_q, block_k, heads_k, diagonal, key)


def _device_of(like):
    """The tvm device of a DLPack tensor (torch, numpy, tvm)."""
    return (like if isinstance(like, tvm_ffi.Tensor) else tvm_ffi.from_dlpack(like)).device


def cuda_stats_rows(seqlen_q: int, packed: bool = False) -> int:
    """Rows of the CUDA backward's row-statistics workspace: padded to whole query tiles; packed
    sequences read one tile further (a sequence's last tile may start anywhere)."""
    from .config import CUDA_BLOCK_Q

    return (-(-seqlen_q // CUDA_BLOCK_Q) + packed) * CUDA_BLOCK_Q


def deterministic_splits(batch: int, heads_k: int, key_tiles: int) -> int:
    """Thread blocks per (batch, kv head) of the deterministic CUDA backward.

    Each owns an fp32 dQ partial (workspace = splits x dQ in fp32), so they are capped at 8:
    enough blocks for a GPU's ~132 SMs at typical batch x heads, bounded memory at any length.
    """
    return max(1, min(key_tiles, 8, -(-256 // (batch * heads_k))))


def _workspace(like, shape: tuple):
    """An fp32 scratch tensor on the device of ``like`` (torch's allocator for torch tensors)."""
    if type(like).__module__.startswith("torch"):
        return like.new_empty(shape, dtype=sys.modules["torch"].float32)
    import tvm

    return tvm.runtime.empty(shape, "float32", _device_of(like))


def read_meta(path: Path) -> dict:
    """The metadata next to an exported library, with errors that name the file."""
    meta_path = Path(str(path) + ".json")
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} (written by export_library next to the library) is missing")
    try:
        meta = settings.read_json(meta_path)
        for field in ("target", "spec", "configs" if kernel_kind(meta) == "flash" else "versions"):
            meta[field]
        meta["target"]["kind"]
        kernel_class(meta)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{meta_path} is not the metadata of exported tvmflash kernels ({type(err).__name__}: "
                         f"{err}); re-export them with this version of tvmflash") from err
    if "sha256" in meta and cache.file_digest(path) != meta["sha256"]:
        raise ValueError(f"{path} does not match the checksum recorded in {meta_path} (modified after export); "
                         "re-export it")
    return meta


def kernel_kind(meta: dict) -> str:
    """Which kernels a library holds, by its metadata: "flash" (forward and backward), "decode" or
    "sinks" (``compiler._module_request``'s name; flash requests carry none)."""
    return meta.get("kernel", "flash")


KERNEL_KINDS = ("flash", "decode", "sinks")


def kernel_class(meta: dict):
    """The kernel object class for a library of this metadata (KeyError for an unknown kind)."""
    return dict(zip(KERNEL_KINDS, (FlashKernels, DecodeKernels, SinkKernels)))[kernel_kind(meta)]


def load(path: str | os.PathLike) -> FlashKernels | DecodeKernels | SinkKernels:
    """Load kernels written by ``export_library`` (``FlashKernels``, ``DecodeKernels`` or
    ``SinkKernels``, as the metadata beside the library says).

    CPU kernels built for an instruction set this CPU lacks are refused (they would crash). CUDA
    kernels exported without a GPU hold CUDA source: with TVM's runtime alone, their binaries
    must lie beside them (``cuda_binaries``, written by ``prebuild``).
    """
    path = Path(path)
    meta = read_meta(path)
    if meta["target"]["kind"] == "cuda":
        _load_cuda_runtime()
        import tvm

        if tvm.base._RUNTIME_ONLY:
            cuda_binaries.serve(path.parent, meta["target"].get("arch", "sm_90"))
    else:
        from .target import missing_isa_features

        missing = missing_isa_features(meta.get("isa_features", []))
        if missing:
            raise RuntimeError(f"{path} was compiled for {meta['target'].get('mcpu')} and uses instructions "
                               f"this CPU lacks ({', '.join(missing)}); compile the kernels here instead")
    try:
        module = load_library(path, meta["target"]["kind"])
        if kernel_kind(meta) != "flash":
            return kernel_class(meta)(module, meta, library=path)
        return FlashKernels(module, meta, library=path, causal=bool(meta.get("causal", False)))
    except (AttributeError, RuntimeError) as err:
        raise RuntimeError(f"{path} is not a library of tvmflash kernels ({err})") from err


def _load_cuda_runtime() -> None:
    """TVM loads its CUDA runtime library while registering its CUDA backend, which in runtime-only
    mode can fail before it gets there; loading a CUDA module needs the library's loader."""
    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    import ctypes

    import tvm

    library = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise RuntimeError(f"cannot load TVM's CUDA runtime ({library}): {err}; a GPU driver (libcuda) and "
                           "libcudart.so.13 must be loadable") from err


# --- small CPU modules: decoding against a KV cache, attention sinks -------------------------------
class _CPUModule:
    """A small compiled CPU module (``compiler._cpu_module``): its ``FUNCTIONS`` on torch's
    threads where its library's parallel launches are routed there (else TVM's pool:
    ``fork_safe``), its metadata and source."""

    FUNCTIONS: tuple[str, ...] = ()

    def __init__(self, module, meta: dict, source_text: str | None = None, library: Path | None = None,
                 loaded_as: Path | None = None):
        self._module = module
        self._library = library
        self.meta = meta
        spec = meta["spec"]
        self.head_dim, self.dtype, self.out_dtype = spec["head_dim"], spec["dtype"], spec["out_dtype"]
        self._source = source_text
        self._on_torch_threads = threads.route(loaded_as or library)  # else TVM's pool: fork_safe
        self._functions = {name: module[name] if self._on_torch_threads else fork_safe(module[name])
                           for name in self.FUNCTIONS}

    def plan_threads(self) -> int:
        """The thread count to plan the work for: torch's when the kernels run on torch's threads."""
        return threads.torch_threads() if self._on_torch_threads else settings.num_threads()

    @functools.cached_property
    def _missing_features(self) -> list[str]:
        from .target import missing_for_cpu_kernels

        return missing_for_cpu_kernels(self.meta["target"], self.meta.get("isa_features", []))

    def _check_runs_here(self, what: str) -> None:
        if self._missing_features:
            raise RuntimeError(f"{what} was compiled for {self.meta['target'].get('mcpu')} and uses instructions "
                               f"this CPU lacks ({', '.join(self._missing_features)}): it would crash here")

    def source(self) -> str:
        if self._source is None:
            raise RuntimeError("this module was loaded without its source")
        return self._source

    def export_library(self, path: str | os.PathLike) -> None:
        """Write the compiled module (a shared library) and its metadata (``path + '.json'``):
        ``load`` reads it back, and ``$TVMFLASH_PREBUILT`` serves it (``tvmflash.prebuild``)."""
        _export(self._module, self._library, self._source, self.meta, path)


class DecodeKernels(_CPUModule):
    """The compiled ``flash_decode`` kernel (``kernels/decode.py``) for one CPU and spec.

    ``decode`` launches it on prepared arguments; ``tvmflash.flash_attn_with_kvcache`` (the
    PyTorch function, ``kvcache.py``) checks the inputs, updates the cache and plans the splits.
    """

    FUNCTIONS = ("flash_decode",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.score_mods = tuple(self.meta["spec"]["score_mods"])
        self._function = self._functions["flash_decode"]

    @functools.cached_property
    def config(self):
        from .config import DecodeConfig

        return DecodeConfig.from_json(self.meta["config"])

    def __repr__(self):
        from .target import key

        mods = "".join(f", {m}" for m in self.score_mods)
        return f"DecodeKernels({key(self.meta['target'])}, head_dim={self.head_dim}, {self.dtype}{mods})"

    def decode(self, q, k_cache, v_cache, out, lse, softmax_scale: float, window: tuple[int, int], num_threads: int,
               seq_info, units, block_table, mod_inputs=()) -> None:
        """out, lse = attention of q against the cache (see ``kernels/decode.py`` for the tables)."""
        self._check_runs_here("this decode kernel")
        if self._on_torch_threads:  # no more threads than units
            num_threads = min(num_threads, max(1, int(units.shape[0])))
            threads.limit(num_threads)
        self._function(q, k_cache, v_cache, out, lse, softmax_scale, window[0], window[1], num_threads, seq_info,
                       units, block_table, *mod_inputs)


class SinkKernels(_CPUModule):
    """The attention sinks' kernels (``kernels/sinks.py``) for one CPU, head dim and dtype (of
    out' and dO): ``sinks.py``'s rescale and gradient, one launch each."""

    FUNCTIONS = ("sink_rescale", "sink_gradient")

    def __repr__(self):
        from .target import key

        return f"SinkKernels({key(self.meta['target'])}, head_dim={self.head_dim}, {self.dtype})"

    def rescale(self, out32, lse, sinks, real, out, lse_out) -> None:
        """out, lse_out = out32 scaled by its keys' share, lse with the sink; padding rows (real
        0) out 0, lse_out the sink (``kernels/sinks.py``)."""
        self._launch("sink_rescale", out32.shape[0] * out32.shape[1], out32, lse, sinks, real, out, lse_out)

    def gradient(self, dout, out, lse, sinks, dsinks) -> None:
        """dsinks (heads,) float32 from dO', out' and lse' (``kernels/sinks.py``)."""
        self._launch("sink_gradient", sinks.shape[0], dout, out, lse, sinks, dsinks)

    def _launch(self, name: str, tasks: int, *args) -> None:
        self._check_runs_here("this sink kernel")
        if self._on_torch_threads:
            threads.limit(min(self.plan_threads(), max(1, tasks)))
        self._functions[name](*args)
