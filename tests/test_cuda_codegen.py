"""The CUDA kernels without a GPU: generated code, nvcc/ptxas, and their math run on the CPU.

* Every variant (fp16/bf16, head dim 64/128, sm_80/sm_90; softcap + ALiBi; a traced score_mod,
  mask_mod and block mask) compiles with ``tvmflash.compile_spec`` here, and its CUDA C compiles the way TVM compiles it when a GPU machine
  loads the module (TVM's ``compile_cuda``: ``--use_fast_math``, its ptxas options), into code
  whose every matrix product is a tensor-core ``mma`` (the exact count is asserted), with the
  registers, spills, barriers and store widths asserted from ptxas's report and the PTX.
  Skipped without nvcc.
* The unscheduled CUDA kernels are ordinary TIR: compiled for this CPU (warps and lanes become
  plain loops), they run against the float64 reference. This checks the fragment layouts, the
  masks, the online softmax and the backward's index arithmetic without a GPU; the schedule
  then only binds loops and swaps in ldmatrix/mma (whose descriptions TVM matches exactly).
* The generated CUDA C itself runs in the CUDA emulator (tools/cuda_emu), which also checks
  barriers, shuffles and memory accesses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tvm

import tvmflash
from conftest import assert_flash_rule, assert_matches_reference, causal_mask, random_inputs
from tvmflash import plan, runtime
from tvmflash.config import CUDAKernelConfig
from tvmflash.kernels import cuda as cuda_kernels
from tvmflash import torch_op
from tvmflash.checks import check_cuda_grid, check_cuda_layout, cuda_layout_problem, info
from tvmflash.reference import reference_attention
from tvmflash.spec import UNLIMITED_WINDOW, Alibi, AttentionSpec, Softcap
from tvmflash.target import host_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import cuda_resources  # benchmarks/ is no package: the nvcc + ptxas steps live there
finally:
    sys.path.pop(0)


# TVM calls nvcc by name (and nvcc its ptxas): the tests need them where TVM looks.
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed (on PATH)")
# Masks (causal, windows) are runtime arguments: one build per dtype, head dim and score/mask mods.
VARIANTS = [(arch, dtype, head_dim, "none") for arch in ("sm_80", "sm_90") for dtype in ("float16", "bfloat16")
            for head_dim in (64, 128)] + [("sm_90", "bfloat16", 64, "softcap+alibi"), ("sm_90", "float16", 128, "softcap+alibi"),
                                          ("sm_90", "bfloat16", 64, "flex"), ("sm_90", "float16", 128, "flex"),
                                          ("sm_90", "bfloat16", 64, "flex+grad")]
SHORT = {"float16": "f16", "bfloat16": "bf16"}


def compile_like_tvm(source: str, arch: str, fast_math: bool = True) -> tuple[dict[str, str], str]:
    """What a GPU machine runs: the PTX of each kernel entry and ptxas's resource report."""
    entries, report, _ = cuda_resources.compile_like_tvm(source, arch, fast_math)
    return entries, report


cuda_spec = cuda_resources.variant_spec


@needs_nvcc
@pytest.mark.parametrize("arch,dtype,head_dim,mods", VARIANTS)
def test_cuda_kernels_assemble_with_tensor_cores(arch, dtype, head_dim, mods):
    kern = tvmflash.compile_spec({"kind": "cuda", "arch": arch}, cuda_spec(head_dim, dtype, mods))
    assert kern.is_cuda and "flash_bwd_kernel" in kern.source()
    entries, report = compile_like_tvm(kern.source(), arch)
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{SHORT[dtype]}.{SHORT[dtype]}.f32"
    tiles_d, tiles_64 = head_dim // 16, 64 // 16
    # Every product of a (64 x 64) tile step runs on tensor cores, two m16n8k16 per 16 x 16 x 16:
    # forward S = Q K^T and O += P V; backward S^T, dV, dP^T, dK and dQ.
    assert entries["flash_fwd_kernel"].count(mma) == 2 * 2 * tiles_d * tiles_64
    assert entries["flash_bwd_kernel"].count(mma) == 2 * 5 * tiles_d * tiles_64
    for name in ("flash_fwd_kernel", "flash_bwd_kernel"):
        assert "ldmatrix.sync.aligned.m8n8.x4" in entries[name]
        assert "ex2.approx" in entries[name]  # exp2 with log2(e) folded into the scale
    assert re.search(r"(red|atom)\.global\.add\.f32", entries["flash_bwd_kernel"])  # dQ, FA2-style
    if mods == "flex+grad":  # and the captured table's gradient, one add per score
        assert "atomicAdd((&(LEARNED_grad_ptr[" in kern.source()
    fwd = cuda_resources.kernel_resources(entries, report, "flash_fwd_kernel")
    # Score mods keep more values live (the mods' inputs; in the backward the modded scores and
    # their derivative, 16 registers per lane): at D = 128 ptxas spills a little in both kernels.
    modded_d128 = mods != "none" and head_dim == 128
    assert fwd["spill_bytes"] <= (32 if modded_d128 else 0)
    # Row max and row sum combine the 4 lanes that share a row with 2 shuffles each (both rows of
    # a lane: 8), so the only block-wide barriers are one after the Q tile, two per key tile
    # (K/V tile written, K/V tile read before the next one overwrites it; was 20) and two
    # around the O tile staged for the 16-byte stores.
    assert fwd["barriers"] == 1 + 2 + 2 and fwd["shuffles"] == 8
    bwd = cuda_resources.kernel_resources(entries, report, "flash_bwd_kernel")
    # The backward works through each query tile one 16-query sub-tile at a time (S^T, P^T, dP^T,
    # dS^T and one dQ tile of 8 registers each besides dK and dV): its query-tile loop no longer
    # spills. What ptxas still spills at TVM's --register-usage-level=10 are a few loop-invariant
    # values of the outer (key tile, GQA head) loops, reloaded once per outer step
    # (`cuda_resources.py --nvdisasm`: no local memory access in the query-tile loop); it was
    # 72-216 bytes at D = 128, up to 29 local loads/stores inside the loop.
    # (72-216 before the sub-tiles, 64-96 with them; runtime window and diagonal added 8 at sm_80)
    assert bwd["spill_bytes"] <= (128 if modded_d128 else 104)
    # per key tile: tiles free, then per query tile: Q/dO/stats tile free, written, dS^T written;
    # at the end of a key tile: dK/dV staged, read back
    assert bwd["barriers"] == 4 + 2
    # Outputs leave as whole rows, 16 bytes per thread and step (were 2-byte stores from the
    # fragment layout): O (the forward also writes 2 LSE floats per lane), dK and dV.
    row_chunks_per_thread = 64 * head_dim * 2 // 16 // 128
    assert fwd["stores"] == {4: 2, 16: row_chunks_per_thread}
    assert bwd["stores"] == {16: 2 * row_chunks_per_thread}
    # The pre-pass: two threads per row of dO and O, 16-byte loads, one shuffle, 3 statistics
    # stored by one thread (was one thread per row, 2-byte loads, a global add per element).
    prep = entries["flash_bwd_prep_kernel"]
    assert prep.count("ld.global.nc.v4.u32") == 2 * head_dim // 16
    assert cuda_resources.kernel_resources(entries, report, "flash_bwd_prep_kernel")["stores"] == {4: 3}
    assert cuda_resources.kernel_resources(entries, report, "flash_bwd_prep_kernel_1")["stores"] == {16: 1}
    # dQ conversion: one thread per 8 elements, 16-byte loads of each fp32 partial. The source
    # stores the 8 rounded values as one 16-byte copy; nvcc splits it into 4 stores.
    assert "ld.global.nc.v4.f32" in entries["flash_bwd_dq_kernel"]
    assert sum(cuda_resources.kernel_resources(entries, report, "flash_bwd_dq_kernel")["stores"].values()) == 4


@needs_nvcc
def test_deterministic_backward_adds_into_its_own_partial():
    """Deterministic mode: block s adds its dQ tiles into partial s (one thread per element, so
    in program order); the atomic mode: every block into partial 0."""
    def dq_add_targets(deterministic):
        kern = tvmflash.compile("cuda", head_dim=128, dtype="bfloat16", causal=True, deterministic=deterministic)
        targets = re.findall(r"atomicAdd\(\(&\(dQacc_ptr\[(.*?)\]\)\)", kern.source())
        assert len(targets) == 1  # in the loop over the 8 values a lane holds of one dQ tile
        return targets

    partial_of_block = re.compile(r"\(\(int64_t\)blockIdx\.x\) \* B\)")
    assert all(partial_of_block.search(t) for t in dq_add_targets(True))
    assert not any(partial_of_block.search(t) for t in dq_add_targets(False))


NVDISASM = os.environ.get("NVDISASM") or shutil.which("nvdisasm")


@needs_nvcc
@pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not installed (set NVDISASM=path, e.g. from the "
                                            "nvidia-cuda-nvdisasm wheel)")
@pytest.mark.parametrize("head_dim,mods,deterministic", [(64, "none", False), (128, "none", True),
                                                         (128, "softcap+alibi", False), (64, "flex", True),
                                                         (64, "flex+grad", False)])
def test_no_local_memory_in_the_mma_loops(head_dim, mods, deterministic, tmp_path):
    """What ptxas still spills are loop invariants of the outer loops: no local-memory load or
    store inside the forward's key-tile loop or the backward's query-tile loop (D = 128 causal
    deterministic had 29 there before the backward worked in 16-query sub-tiles). Not asserted:
    flex's traced mods with a block mask at D = 128, where 4-12 land in the loop (it varies with
    small code changes)."""
    kern = tvmflash.compile_spec({"kind": "cuda", "arch": "sm_90"}, cuda_spec(head_dim, "bfloat16", mods),
                                 deterministic=deterministic)
    cuda_resources.compile_like_tvm(kern.source(), "sm_90", cubin=tmp_path / "k.cubin")
    local = cuda_resources.local_memory_in_mma_loops(tmp_path / "k.cubin", NVDISASM)
    assert local["flash_fwd_kernel"][1] == 0 and local["flash_bwd_kernel"][1] == 0


# --- --use_fast_math ----------------------------------------------------------------------------
# TVM compiles the CUDA source with --use_fast_math when a GPU machine loads the module
# (-ftz=true -prec-div=false -prec-sqrt=false -fmad=true, and fast variants of the math
# functions). The kernels are written so that of all this only the subnormal flush remains
# (exp2 is ex2.approx either way, 1/l is __frcp_rn, the LSE is float64, mma has no .ftz), and
# the flush cannot change a result: the two tests below.
@needs_nvcc
@pytest.mark.parametrize("dtype,head_dim,deterministic", [("float16", 64, False), ("bfloat16", 128, True)])
def test_fast_math_changes_only_subnormal_flushing(dtype, head_dim, deterministic):
    """The PTX with TVM's flags equals the PTX without --use_fast_math (TVM's own switch,
    TVM_CUDA_NVCC_NO_FAST_MATH) up to the .ftz suffix: no approximate division, reciprocal,
    square root or math function is left to the flag (a plain 1 / l became rcp.approx)."""
    kern = tvmflash.compile({"kind": "cuda", "arch": "sm_90"}, head_dim=head_dim, dtype=dtype,
                            deterministic=deterministic)
    fast, _ = compile_like_tvm(kern.source(), "sm_90")
    precise, _ = compile_like_tvm(kern.source(), "sm_90", fast_math=False)
    assert sorted(fast) == sorted(precise)
    for name in fast:
        assert fast[name].replace(".ftz", "") == precise[name].replace(".ftz", ""), name
    assert "rcp.rn.ftz.f32" in fast["flash_fwd_kernel"] and "rcp.approx.ftz.f32" not in fast["flash_fwd_kernel"]


FLOAT_MATH = re.compile(r"\b((?:div|rcp|sqrt|rsqrt|tanh|ex2|lg2|sin|cos)\.[a-z0-9.]+)")


@needs_nvcc
@pytest.mark.parametrize("mods", ["softcap+alibi", "flex"])
def test_fast_math_leaves_score_mods_accurate(mods):
    """With score mods --use_fast_math also turns their fp32 divisions (s / softcap) into
    div.approx (2 ulp), and nothing else: CUDA's own tanhf would become tanh.approx (relative
    error 2^-11, 1.5 % of P at softcap 30), so tanh, exp and sigmoid are written on ex2."""
    import collections

    kern = tvmflash.compile_spec({"kind": "cuda", "arch": "sm_90"}, cuda_spec(64, "float16", mods))
    fast, _ = compile_like_tvm(kern.source(), "sm_90")
    precise, _ = compile_like_tvm(kern.source(), "sm_90", fast_math=False)
    for name in ("flash_fwd_kernel", "flash_bwd_kernel"):
        ops = {tag: collections.Counter(op.replace(".ftz", "") for op in FLOAT_MATH.findall(ptx[name]))
               for tag, ptx in (("fast", fast), ("precise", precise))}
        assert not any(op.startswith("tanh") for op in ops["fast"]), name
        divisions = ops["precise"].pop("div.rn.f32", 0)
        assert ops["fast"].pop("div.approx.f32", 0) == divisions, name
        assert ops["fast"] == ops["precise"], name


def test_flushing_subnormals_moves_no_result_beyond_2_pow_minus_100(gen, seed):
    """-ftz=true flushes fp32 subnormals (|x| < 2^-126) to zero. The kernels' math run on the CPU
    with its flush-to-zero and denormals-are-zero modes (the same flush, on inputs and results
    of every float op) moves no output by more than 2^-100, on inputs where hundreds of
    probabilities P = 2^(s - lse) fall into the subnormal range: such a P only ever meets terms
    far larger (the row's largest P is 1), or is rounded to fp16/bf16 next to them; only results
    that are themselves ~1e-38 can change."""
    tiny = 2.0**-126
    for dtype in ("float16", "bfloat16"):
        lib = emulated(64, dtype)
        q, k, v = random_inputs(gen, 1, 61, 97, 2, 1, 64, dtype)
        dout = torch.randn(q.shape, generator=gen).to(q.dtype)
        scale = 3.0  # logits of spread ~150: many probabilities between 2^-149 and 2^-126
        probs = torch.softmax(torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(2, 2))
                              * scale + torch.where(causal_mask(61, 97), 0.0, float("-inf")), -1)
        assert ((probs >= 2.0**-149) & (probs < tiny)).sum() > 100
        plain = run_emulated(lib, q, k, v, dout, 2, scale, CAUSAL_WINDOW)
        assert torch.set_flush_denormal(True), "this CPU cannot flush subnormals"
        try:
            flushed = run_emulated(lib, q, k, v, dout, 2, scale, CAUSAL_WINDOW)
            # control: the mode reaches the kernels (a subnormal Delta = dO . O is flushed)
            stats = torch.zeros(1, 2, 3, runtime.cuda_stats_rows(61))
            small_dout = torch.full_like(dout, 2.0**-70)
            lib["flash_bwd_prep"](small_dout, torch.full_like(q, 2.0**-70), plain[1], stats,
                                  torch.empty(1, 1, 61, 2, 64))
            assert (stats[:, :, 2, :61] == 0).all()
        finally:
            torch.set_flush_denormal(False)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), plain, flushed):
            # Flushed terms are < 2^-126; the sums and factors they meet here (61 queries, |dS|,
            # |q| x scale of ~1e2 each) cannot move a result by 2^-100. They did move results that
            # are themselves ~1e-38 (a key row that one query sees with P ~ 2^-130: dk ~ 1e-38
            # became 0), so results agree within 2^-100, not bit for bit.
            moved = (a.double() - b.double()).abs().max().item()
            assert moved <= 2.0**-100, f"{dtype} {name}: flushing subnormals moved a result by {moved:.3g} (seed {seed})"


def test_cuda_parameter_errors():
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        tvmflash.compile("cuda", head_dim=64, dtype="float32")
    for head_dim in (72, 256):
        with pytest.raises(ValueError, match="multiple of 16 up to 128"):
            tvmflash.compile("cuda", head_dim=head_dim, dtype="float16")
    with pytest.raises(ValueError, match="sm_80 or newer"):
        tvmflash.compile({"kind": "cuda", "arch": "sm_75"}, head_dim=64, dtype="float16")


def test_cuda_kernels_reject_cpu_tensors_and_unaligned_inputs(gen):
    kern = tvmflash.compile("cuda", head_dim=64, dtype="float16")
    q, k, v = random_inputs(gen, 1, 8, 8, 2, 2, 64, "float16")
    with pytest.raises(ValueError, match="run on cuda tensors"):
        kern.forward(q, k, v, torch.empty_like(q), torch.empty(1, 2, 8))
    base = torch.zeros(1 + 8 * 2 * 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_cuda_layout(q=base[1:].view(1, 8, 2, 64))
    with pytest.raises(ValueError, match="multiples of 8"):
        check_cuda_layout(k=torch.zeros(1, 8, 2, 68, dtype=torch.float16)[..., :64])
    check_cuda_layout(q=q, k=k, v=v)  # contiguous tensors pass
    check_cuda_grid(65535)
    with pytest.raises(ValueError, match="split the batch"):
        check_cuda_grid(65536)


def test_layout_fix_copies_what_torch_calls_contiguous():
    """A view at a 2-byte storage offset is contiguous to torch (``contiguous()`` would return it
    unchanged) but not 16-byte aligned: the torch op must copy it into a fresh allocation."""
    base = torch.randn(1 + 1 * 5 * 3 * 64, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    shifted = base[1:].view(1, 5, 3, 64)
    assert shifted.is_contiguous() and cuda_layout_problem(info(shifted)) is not None
    fixed = torch_op._cuda_readable(shifted)
    assert fixed.data_ptr() != shifted.data_ptr() and torch.equal(fixed, shifted)
    assert cuda_layout_problem(info(fixed)) is None
    aligned = torch.randn(2, 5, 3, 64).to(torch.float16)
    assert torch_op._cuda_readable(aligned) is aligned  # no copy when the kernels can read it


def test_layout_check_ignores_strides_of_size_one_dims():
    """torch gives size-1 dims arbitrary strides (and still calls the tensor contiguous); the
    kernels never multiply them by a nonzero index, so they must not be rejected."""
    t = torch.zeros(1, 5, 1, 64, dtype=torch.float16).as_strided((1, 5, 1, 64), (7, 64, 3, 1))
    assert t.is_contiguous()
    assert cuda_layout_problem(info(t)) is None and torch_op._cuda_readable(t) is t
    odd = torch.zeros(2, 5, 2, 68, dtype=torch.float16)[..., :64]  # a real odd stride (68) still fails
    assert "multiples of 8" in cuda_layout_problem(info(odd))


def test_deterministic_splits_bound_the_workspace():
    for batch, heads_k, key_tiles in ((1, 1, 8192), (1, 1, 3), (64, 32, 100), (2, 8, 1)):
        splits = runtime.deterministic_splits(batch, heads_k, key_tiles)
        assert 1 <= splits <= min(8, key_tiles)
    assert runtime.deterministic_splits(1, 1, 8192) == 8  # few heads: as many blocks as allowed
    assert runtime.deterministic_splits(64, 32, 100) == 1  # many heads fill the GPU already


# --- the kernels' math, emulated on the CPU ---------------------------------------------------
U = UNLIMITED_WINDOW
FULL_WINDOW, CAUSAL_WINDOW = (U, U), (U, 0)


def emulated(head_dim: int, dtype: str, score_mods=(), mask_mod=None, block_sparse=False):
    """The unscheduled CUDA kernels compiled for this CPU (dQ partials without atomics)."""
    spec = AttentionSpec(head_dim, dtype, score_mods=tuple(score_mods), mask_mod=mask_mod, block_sparse=block_sparse)
    mod = tvm.IRModule({
        "flash_fwd": cuda_kernels.cuda_forward(spec, CUDAKernelConfig("forward"), on_cpu=True),
        "flash_bwd_prep": cuda_kernels.cuda_backward_prep(head_dim, dtype),
        "flash_bwd": cuda_kernels.cuda_backward(spec, CUDAKernelConfig("backward"), atomic_dq=False, on_cpu=True),
        "flash_bwd_dq": cuda_kernels.cuda_backward_dq(head_dim, dtype),
    })
    # LLVM's -O2 and above miscompile the backward's 16-query sub-tile loop here (the Delta
    # values read back from the row-statistics buffer come out as garbage; -O0/-O1 are right,
    # and so is the generated CUDA run by the CUDA emulator): compile this test vehicle at -O1.
    target = tvm.target.Target({**dict(host_target().export()), "opt-level": 1})
    return tvm.compile(mod, target=target)


def sequence_tables(q, k, diagonal=None, cu_seqlens=None):
    """plan.py's sequence table and query-tile map at the CUDA kernels' 64 x 64 tiles, as torch
    tensors: batched, or packed with ``cu_seqlens`` = (cu_seqlens_q, cu_seqlens_k)."""
    if cu_seqlens is None:
        seqs = plan.batched(q.shape[0], q.shape[1], k.shape[1], block_q=64, block_k=64, heads_k=k.shape[2],
                            diagonal=diagonal)
    else:
        seqs = plan.varlen(*cu_seqlens, block_q=64, block_k=64, heads_k=k.shape[2])
    return seqs, [torch.from_numpy(a) for a in seqs.arrays()[:2]]


def run_emulated(lib, q, k, v, dout, splits: int, scale: float, window=FULL_WINDOW, diagonal=None, mod_inputs=(),
                 block_mask=(), mod_grads=(), cu_seqlens=None):
    """What FlashKernels.forward/backward launch on a GPU, with poisoned outputs and workspaces.
    ``window``: (left, right) in the kernels' form (UNLIMITED_WINDOW for no limit);
    ``block_mask``: (tile states, kv ranges, query ranges) at the kernels' tiles; ``cu_seqlens``:
    (cu_seqlens_q, cu_seqlens_k) of packed sequences in (1, total, heads, head_dim) tensors."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqs, (table, q_tile_seq) = sequence_tables(q, k, diagonal, cu_seqlens)
    nan = float("nan")
    out, lse = torch.full_like(q, nan), torch.full((batch, heads, seqlen_q), nan)
    lib["flash_fwd"](q, k, v, out, lse, scale, *window, table, q_tile_seq, *mod_inputs, *block_mask[:2])
    stats = torch.full((batch, heads, 3, runtime.cuda_stats_rows(seqlen_q, cu_seqlens is not None)), nan)
    dq_acc = torch.full((splits, batch, seqlen_q, heads, head_dim), nan)
    dq, dk, dv = (torch.full_like(t, nan) for t in (q, k, v))
    lib["flash_bwd_prep"](dout, out, lse, stats, dq_acc)
    lib["flash_bwd"](dout, q, k, v, stats, dq_acc, dk, dv, scale, splits, *window, table, *mod_inputs, *mod_grads,
                     *block_mask[::2])
    lib["flash_bwd_dq"](dq_acc, dq, scale)
    return out, lse, dq, dk, dv


def test_backward_prep_writes_no_nan_for_rows_without_keys(gen):
    """Causal with more queries than keys: the first rows see no key (LSE = -inf). The pre-pass
    must give them lse2 = (-inf, 0), not a NaN lo part ((-inf) - (-inf))."""
    lib = emulated(64, "float16")
    batch, seqlen_q, seqlen_k, heads = 1, 83, 29, 2
    q, k, v = random_inputs(gen, batch, seqlen_q, seqlen_k, heads, heads, 64, "float16")
    out, lse = torch.empty_like(q), torch.empty(batch, heads, seqlen_q)
    lib["flash_fwd"](q, k, v, out, lse, 0.125, *CAUSAL_WINDOW, *sequence_tables(q, k)[1])
    blind = seqlen_q - seqlen_k  # rows 0 .. blind - 1 see no key
    assert torch.isinf(lse[..., :blind]).all() and torch.isfinite(lse[..., blind:]).all()
    stats = torch.full((batch, heads, 3, runtime.cuda_stats_rows(seqlen_q)), float("nan"))
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    lib["flash_bwd_prep"](dout, out, lse, stats, torch.empty(1, batch, seqlen_q, heads, 64))
    assert not torch.isnan(stats).any()
    assert torch.equal(stats[:, :, 1, :blind], torch.zeros(batch, heads, blind))
    assert (stats[:, :, 0, :blind] == float("-inf")).all()


@pytest.mark.parametrize("dtype,head_dim,causal,splits", [
    ("float16", 64, True, 2), ("bfloat16", 64, False, 3), ("float16", 128, False, 1), ("bfloat16", 32, True, 2)])
def test_cuda_kernel_math_on_the_cpu(dtype, head_dim, causal, splits, gen, seed):
    lib = emulated(head_dim, dtype)
    shapes = [dict(batch=2, seqlen_q=70, seqlen_k=133, heads=4, heads_k=2),  # GQA, odd lengths
              dict(batch=1, seqlen_q=150, seqlen_k=37, heads=3, heads_k=1),  # causal: rows without keys
              dict(batch=1, seqlen_q=1, seqlen_k=65, heads=2, heads_k=2)]  # one query, one key past a tile
    for shape in shapes:
        q, k, v = random_inputs(gen, head_dim=head_dim, dtype=dtype, **shape)
        dout = torch.randn(q.shape, generator=gen).to(q.dtype)
        scale = head_dim**-0.5
        results = run_emulated(lib, q, k, v, dout, splits, scale, CAUSAL_WINDOW if causal else FULL_WINDOW)
        assert_matches_reference(f"emulated {shape} {dtype} d={head_dim} causal={causal}", (q, k, v, dout),
                                 results, causal, seed, scale)


def _random_window(gen, seqlen: int):
    """flash-attn's (left, right): -1 = no limit on that side."""
    def side():
        return -1 if torch.rand(1, generator=gen).item() < 0.3 else int(torch.randint(0, seqlen + 8, (1,), generator=gen))
    return side(), side()


def _kernel_window(window):
    return tuple(U if w < 0 else w for w in window)


@pytest.mark.parametrize("dtype,head_dim,mods", [("float16", 64, ()), ("bfloat16", 32, (Softcap(), Alibi())),
                                                 ("float16", 128, (Alibi(),))])
def test_windows_softcap_alibi_on_the_cpu(dtype, head_dim, mods, gen, seed):
    """Sliding windows on both sides (runtime arguments: one build serves every window), the tile
    ranges they skip, softcap and ALiBi (per head and per batch x head), against float64."""
    lib = emulated(head_dim, dtype, mods)
    shapes = [dict(batch=2, seqlen_q=131, seqlen_k=70, heads=4, heads_k=2),
              dict(batch=1, seqlen_q=70, seqlen_k=200, heads=2, heads_k=1)]
    for shape in shapes:
        q, k, v = random_inputs(gen, head_dim=head_dim, dtype=dtype, **shape)
        dout = torch.randn(q.shape, generator=gen).to(q.dtype)
        for _ in range(3):
            window = _random_window(gen, max(shape["seqlen_q"], shape["seqlen_k"]))
            variant, inputs = {"window_size": window}, []
            if any(isinstance(m, Softcap) for m in mods):
                variant["softcap"] = float(torch.empty(1).uniform_(0.5, 8, generator=gen))
                inputs.append(torch.tensor([variant["softcap"]]))
            if any(isinstance(m, Alibi) for m in mods):
                per_batch = bool(torch.randint(0, 2, (1,), generator=gen))
                slopes = torch.rand((shape["batch"],) * per_batch + (shape["heads"],), generator=gen)
                variant["alibi_slopes"] = slopes
                inputs.append(slopes.reshape(-1, shape["heads"]))
            scale = head_dim**-0.5
            results = run_emulated(lib, q, k, v, dout, 2, scale, _kernel_window(window), mod_inputs=inputs)
            assert_matches_reference(f"emulated {shape} {dtype} d={head_dim} {variant}", (q, k, v, dout), results,
                                     False, seed, scale, **variant)


_relative_bias = cuda_resources.relative_bias  # reads a captured relative-position table


def _soft_clip(score, b, h, q_idx, kv_idx):  # transcendental functions: CUDA's own (tanhf, expf)
    return 3.0 * torch.tanh(score / 3.0) + torch.sigmoid(score) * 0.5


@pytest.mark.parametrize("score_mod", [_relative_bias, _soft_clip])
def test_flex_mods_and_block_masks_on_the_cpu(score_mod, gen, seed):
    """Traced score_mod and mask_mod (a captured document-id tensor) fused into the CUDA kernels,
    with a block mask at their 64 x 64 tiles (empty tiles skipped in the forward, full tiles
    skip the mask_mod), torch flex's indexing (diagonal 0); against float64."""
    from tvmflash import flex_trace
    from tvmflash.flex import create_block_mask, query_ranges, tile_maps

    batch, heads, heads_k, seqlen_q, seqlen_k = 2, 4, 2, 150, 203
    # three documents per sequence, the first long enough for tiles that are wholly inside it
    starts = torch.randint(130, 170, (batch, 1), generator=gen)
    positions = torch.arange(max(seqlen_q, seqlen_k))
    docs = (positions >= starts).long() + (positions >= starts + 20).long()

    def same_document(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx + 40)

    spec_mods = (flex_trace.trace_score_mod(score_mod),)
    mask_mod = flex_trace.trace_mask_mod(same_document)
    lib = emulated(64, "bfloat16", spec_mods, mask_mod, block_sparse=True)
    block_mask = create_block_mask(same_document, batch, None, seqlen_q, seqlen_k, BLOCK_SIZE=64)
    tiles = tile_maps(block_mask, seqlen_q, seqlen_k, 64, 64)
    assert all((tiles[0] == state).any() for state in (0, 1, 2))  # empty, partial and full tiles occur
    q, k, v = random_inputs(gen, batch, seqlen_q, seqlen_k, heads, heads_k, 64, "bfloat16")
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    captured = [c.tensor.contiguous() for c in (*spec_mods[0].captured, *mask_mod.captured)]
    ranges = query_ranges(tiles[0])
    assert (ranges[..., 0] > 0).any()  # the backward skips the query tiles before each key tile's documents
    results = run_emulated(lib, q, k, v, dout, 2, 0.125, diagonal=0, mod_inputs=captured,
                           block_mask=(*tiles, ranges))
    mask = flex_trace.dense_mask(same_document, batch, heads, seqlen_q, seqlen_k)
    assert_matches_reference(f"emulated flex {score_mod.__name__}", (q, k, v, dout), results, False, seed, 0.125,
                             score_mod=score_mod, mask=mask)


# --- the generated CUDA itself, run by the CUDA emulator ------------------------------------------
EMULATOR = Path(__file__).resolve().parents[1] / "tools" / "cuda_emu" / "check.py"


@pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator is built with g++")
@pytest.mark.parametrize("args", [
    ["--head-dim", "128", "--dtype", "bfloat16", "--mods", "none", "--window=-1,0", "--pad", "8", "--deterministic",
     "--varlen", "--shape", "B=3,Nq=150,Nk=100,H=3,Hk=1"],
    ["--head-dim", "64", "--dtype", "float16", "--mods", "softcap+alibi", "--window=40,7", "--deterministic",
     "--shape", "B=2,Nq=70,Nk=133,H=4,Hk=2"],
    ["--head-dim", "64", "--dtype", "bfloat16", "--mods", "flex+grad", "--window=-1,0",
     "--shape", "B=1,Nq=200,Nk=300,H=2,Hk=1"]])
def test_generated_cuda_runs_in_the_emulator(args):
    """The scheduled kernels' CUDA C (tensorized ldmatrix/mma, warp shuffles, barriers) run on the
    CPU by tools/cuda_emu, one fiber per CUDA thread: results by the flash-attn rule against
    float64, and no race, uninitialised shared read, out-of-bounds or misaligned access, deadlock
    or divergent barrier (the unscheduled kernels above check the math; this checks the code).
    The first packs 3 sequences (varlen); the third has a traced score_mod whose captured table
    gets its gradient (atomicAdd), a traced mask_mod and a block mask."""
    run = subprocess.run([sys.executable, str(EMULATOR), *args], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in run.stdout.splitlines() if "emu stats" in ln]
    assert run.returncode == 0 and lines and all(": OK |" in ln for ln in lines), run.stdout + run.stderr[-3000:]
    assert all("races=0 uninit=0 oob=0 misaligned=0 deadlock=0 divergent=0" in ln for ln in lines), run.stdout


def test_stages_keep_the_block_names_the_schedules_find():
    """The kernels are sequences of stage macros (``kernels/cuda_stages.stage``). TVMScript suffixes the
    blocks of a macro's later expansions (``pv_1``, ``dv_2``), and the schedules find the stages by
    block name: every call keeps the name it passes, and every name a schedule looks up exists."""
    from tvmflash.schedules import cuda as schedules

    spec = cuda_spec(64, "float16", "flex+grad")
    found = {kind: re.findall(r'T\.sblock\("(\w+)"\)', func.script()) for kind, func in (
        ("forward", cuda_kernels.cuda_forward(spec, CUDAKernelConfig("forward"))),
        ("backward", cuda_kernels.cuda_backward(spec, CUDAKernelConfig("backward"))))}
    wanted = {"forward": {n for n, _ in schedules.FORWARD_FRAGMENTS} | set(schedules.FORWARD_LANE_STAGES) | {
                  p for p, _, _ in schedules.FORWARD_PRODUCTS} | {"score_mod", "load_q", "store_o"},
              "backward": {n for n, _ in schedules.BACKWARD_FRAGMENTS} | set(schedules.BACKWARD_LANE_STAGES) | {
                  p for p, _, _ in schedules.BACKWARD_PRODUCTS} | {"score_mod", "captured_grads", "store_dkv"}}
    for kind, names in found.items():
        assert len(names) == len(set(names)), kind
        assert not [n for n in names if re.search(r"_\d+$", n)], kind
        assert wanted[kind] <= set(names), (kind, wanted[kind] - set(names))


def test_one_cuda_build_serves_every_mask():
    """Causal and windows are runtime arguments of the CUDA kernels too: ``causal`` is only the
    default of the calls, and both defaults share one compiled module."""
    full = tvmflash.compile("cuda", head_dim=64, dtype="float16")
    causal = tvmflash.compile("cuda", head_dim=64, dtype="float16", causal=True)
    assert causal.causal and not full.causal
    assert causal.meta["cache_key"] == full.meta["cache_key"] and causal._module is full._module
    assert "window_left" in full.source() and "seq_table" in full.source()


def test_what_the_cuda_kernels_do_not_support_yet_says_so():
    from tvmflash import flex_trace

    table = torch.zeros(4, 64, requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).clamp(-31, 32) + 31]

    trained = AttentionSpec(64, "float16", score_mods=(flex_trace.trace_score_mod(learnable),))
    assert tvmflash.compile_spec("cuda", trained).is_cuda  # atomic adds: any order
    with pytest.raises(NotImplementedError, match="deterministic gradients of captured tensors .*table"):
        tvmflash.compile_spec("cuda", trained, deterministic=True)
    with pytest.raises(NotImplementedError, match="float32 results"):
        tvmflash.compile_spec("cuda", AttentionSpec(64, "float16", "float32"))


def test_captured_tensor_gradients_on_the_cpu(gen, seed):
    """A learnable relative-position bias table: its gradient is scatter-added per score
    (atomicAdd on the GPU, plain adds here) from dL/dX = P (dP - Delta), against float64 autograd."""
    from tvmflash import flex_trace

    table = torch.randn(4, 64, generator=gen).requires_grad_()

    def learned(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).clamp(-31, 32) + 31]

    lib = emulated(64, "float16", (flex_trace.trace_score_mod(learned),))
    batch, seqlen_q, seqlen_k, heads, heads_k = 2, 97, 150, 4, 2
    q, k, v = random_inputs(gen, batch, seqlen_q, seqlen_k, heads, heads_k, 64, "float16")
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    grad = torch.zeros(table.numel())  # the CUDA kernels add into it
    results = run_emulated(lib, q, k, v, dout, 2, 0.125, CAUSAL_WINDOW, mod_inputs=[table.detach()],
                           mod_grads=[grad])

    def with_table(t):
        return lambda score, b, h, i, j: score + t[h, (i - j).clamp(-31, 32) + 31].to(score.dtype)

    assert_matches_reference("emulated learned bias", (q, k, v, dout), results, True, seed, 0.125,
                             score_mod=with_table(table.detach()))
    table_grads = {}
    for dt in (torch.float64, torch.float16):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v, table)]
        out, _ = reference_attention(*leaves[:3], True, 0.125, score_mod=with_table(leaves[3]), dtype=dt)
        table_grads[dt] = torch.autograd.grad(out, leaves[3], dout.to(dt))[0].reshape(-1)
    f64 = table_grads[torch.float64]
    assert f64.abs().max() > 1 and (grad != 0).sum() > 32  # a real gradient, spread over the table
    assert_flash_rule("d table", grad, f64, table_grads[torch.float16].float(), torch.float32, seed, ulps=16,
                      magnitude=float(f64.abs().max()) * 16 + 1)


@pytest.mark.parametrize("dtype,head_dim,mods", [("bfloat16", 64, ()), ("float16", 32, (Softcap(), Alibi()))])
def test_packed_sequences_on_the_cpu(dtype, head_dim, mods, gen, seed):
    """varlen: sequences packed in (1, total, heads, head_dim) tensors with cu_seqlens, one build
    for them and batched tensors (plan.py's table). Each sequence against float64 attention on
    its own rows, with a window, softcap and per-sequence ALiBi slopes; an empty sequence too."""
    lib = emulated(head_dim, dtype, mods)
    heads, heads_k = 4, 2
    lens_q = [int(torch.randint(1, 150, (1,), generator=gen)) for _ in range(3)] + [0]
    lens_k = [int(torch.randint(1, 150, (1,), generator=gen)) for _ in range(4)]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()]) for n in (lens_q, lens_k))
    q, k, v = (t[:, :n] for t, n in zip(random_inputs(gen, 1, sum(lens_q), sum(lens_k), heads, heads_k, head_dim, dtype),
                                         (sum(lens_q), sum(lens_k), sum(lens_k))))
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    window = _random_window(gen, 150)
    variant, inputs = {"window_size": window}, []
    if mods:
        variant["softcap"] = 4.0
        slopes = torch.rand(len(lens_q), heads, generator=gen)
        inputs = [torch.tensor([4.0]), slopes]
    scale = head_dim**-0.5
    results = run_emulated(lib, q, k, v, dout, 2, scale, _kernel_window(window), mod_inputs=inputs,
                           cu_seqlens=(cu_q.tolist(), cu_k.tolist()))
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
        if q1 == q0:
            continue
        rows, keys = slice(q0, q1), slice(k0, k1)
        ours = (results[0][:, rows], results[1][..., rows], results[2][:, rows], results[3][:, keys],
                results[4][:, keys])
        per_sequence = {**variant, **({"alibi_slopes": slopes[b]} if mods else {})}
        assert_matches_reference(f"packed sequence {b} ({q1 - q0} x {k1 - k0}) {dtype} {variant}",
                                 (q[:, rows], k[:, keys], v[:, keys], dout[:, rows]), ours, False, seed, scale,
                                 **per_sequence)
