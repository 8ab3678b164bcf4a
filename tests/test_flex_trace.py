"""The score_mod / mask_mod translator (tvmflash.flex_trace) against torch itself.

Every function of the gallery below is traced, its emitted TIR expressions (value, d/dscore,
captured-tensor gradients as scatter-adds) are compiled into one small kernel per function (all
in one module, one compile), and evaluated over random (b, h, q_idx, kv_idx, score) points. The
reference is the same Python function evaluated by torch on the same points (torch.vmap), in
float64 where it is differentiable, with gradients from torch autograd; captured gradients are
compared after summing over the points, exactly what the scatter-add does.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
import tvm
from tvm import tirx

from tvmflash.flex_trace import (
    FlexTraceError,
    apply_score_mod_dense,
    dense_mask,
    supported_ops,
    trace_mask_mod,
    trace_score_mod,
)
from tvmflash.target import host_target

B, H, NQ, NK = 2, 4, 24, 40
POINTS = 512


# ---------------------------------------------------------------------------------------------
# The gallery: factories taking the captured tensors, so the same function can be built over
# float32 tensors (traced, read by the kernel) and float64 copies of the same values (reference).


def t5_bucket(rel, num_buckets=32, max_distance=64):
    """T5's bidirectional relative-position bucket (transformers' _relative_position_bucket)."""
    num_buckets //= 2
    buckets = (rel > 0).to(torch.long) * num_buckets
    n = torch.abs(rel)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, n, large)


def score_gallery(t):
    """name -> score_mod over the captured tensors ``t`` (a dict)."""
    slopes, table, t5_table, c, w = t["slopes"], t["table"], t["t5_table"], t["c"], t["w"]
    t64, tbf = t["t64"], t["tbf"]
    scale_t = torch.tensor(0.5)

    def in_place(s, b, h, q, kv):
        s = s.clone()
        s.add_(1)
        s.mul_(slopes[h])
        return s

    return {
        "identity": None,
        "times_two_plus_one": lambda s, b, h, q, kv: s * 2 + 1,
        "softcap": lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0),
        "alibi": lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
        "relative_bias": lambda s, b, h, q, kv: s + table[h, q - kv + NK],
        "relative_bias_nested": lambda s, b, h, q, kv: s + table[h][kv - q] * 0.5 + table[0, 3],
        "learnable_softcap": lambda s, b, h, q, kv: c * torch.tanh(s / c),
        "t5": lambda s, b, h, q, kv: s + t5_table[h, t5_bucket(kv - q)],
        "causal_as_score": lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")),
        "integer_math": lambda s, b, h, q, kv: (
            s + (q - kv) // 3 + (q - kv) % 5 + torch.div(q - kv, 4, rounding_mode="trunc")
            + torch.fmod(kv - q, 3) * 10 + torch.remainder(s, 1.5) + torch.div(s, 0.7, rounding_mode="floor")
        ),
        "float_ops": lambda s, b, h, q, kv: (
            torch.sigmoid(s) + torch.exp2(s / 8) + torch.log1p(s.abs()) + torch.sqrt(s.abs() + 1)
            + torch.rsqrt(s * s + 1) + torch.clamp(s, -1, 1) + torch.maximum(s, torch.zeros_like(s))
            + torch.erf(s) + torch.sin(s) * torch.cos(s) + s**2 / 50 + s.pow(3) / 1000 + torch.exp(-s.abs())
            + torch.log(s.abs() + 2) + torch.log2(s.abs() + 3) + torch.atan(s) + torch.relu(s - 1)
            + torch.clamp_min(s, 0.5) - torch.clamp_max(s, -0.5) + torch.minimum(s, s * s)
        ),
        "casts": lambda s, b, h, q, kv: s + (s * 3).to(torch.int32) + (q > kv).float() + (kv - q).to(torch.int8)
        * 0.25 + s.to(torch.float16).float() + scale_t * s,
        "mask_in_score": lambda s, b, h, q, kv: torch.where((q - kv).abs() <= 5, s * slopes[h % 2], s - 100.0),
        "bias_only": lambda s, b, h, q, kv: table[h, q - kv + NK] * 1.0,
        "in_place": in_place,
        "views_of_learnable": lambda s, b, h, q, kv: (
            s * w.select(0, 1) + w[2:4].sum() + w[-1] + (s.unsqueeze(0).expand(3) * w[:3]).sum()
        ),
        "where_of_learnable": lambda s, b, h, q, kv: torch.where(q > kv, table[h, q - kv], 0.0) + s,
        "other_dtypes": lambda s, b, h, q, kv: s + t64[h, kv - q + NQ] + tbf[h, kv - q + NQ] * 2,
        "powers_and_rounding": lambda s, b, h, q, kv: (
            torch.pow(1.5, s / 4) + s.abs() ** 1.3 + 2 ** (s / 8) + torch.round(s * 2.5) + torch.trunc(s)
            + torch.ceil(s) + torch.frac(s) + torch.sign(s)
        ),
        "more_float_ops": lambda s, b, h, q, kv: (
            torch.expm1(s / 10) + torch.expm1(s / 1000) * 100 + torch.sinh(s / 4) + torch.sinh(s / 100) * 10
            + torch.cosh(s / 4) + torch.tan(s / 16) + torch.asin(torch.tanh(s) * 0.9)
            + torch.acos(torch.tanh(s / 2) * 0.9)
            + torch.atan2(s, s * s + 1) + torch.log10(s * s + 1) + torch.exp(s / 5) + torch.reciprocal(s * s + 2)
            + torch.square(s) / 30 + torch.lerp(s, s * s, 0.25) / 20
        ),
        "activations": lambda s, b, h, q, kv: (
            torch.nn.functional.gelu(s) + torch.nn.functional.gelu(s / 2, approximate="tanh")
            + torch.nn.functional.silu(s) + torch.nn.functional.softplus(s, beta=2, threshold=5)
            + torch.nn.functional.leaky_relu(s, 0.1) + torch.logaddexp(s, s / 2)
            + torch.nan_to_num(torch.log(s), nan=-3.0, neginf=-7.0) * 0.25
        ),
        "decomposed_ops": lambda s, b, h, q, kv: (  # ops traced through torch's decompositions
            s * w.mean() + table[h].reshape(8, -1).t()[1, 2] + table[:2, :3].transpose(0, 1)[2, h % 2]
            + torch.arange(3).sum() * 0.5 + torch.arange(1, 4).float().mean() + s.detach() * 0.25
            + torch.zeros(2).sum() + torch.ones(2, dtype=torch.int64).sum() + s.new_full((), 1.5) + torch.rsub(s, 2)
            + s.masked_fill(q > kv, -2.0) * c + torch.clamp_min(s, w[0]) + torch.clamp_max(s, w[1]) + torch.sgn(kv - q)
            + torch.full_like(s, 3).fill_(2.0) * w[2] + s.new_ones(()) * 0.5
        ),
        "floor_division": lambda s, b, h, q, kv: (
            torch.div(s, 0.1, rounding_mode="floor") + torch.floor_divide(q - kv, -3) + torch.remainder(q - kv, -4)
        ),
    }


def mask_gallery(t):
    from torch.nn.attention.flex_attention import and_masks, or_masks

    doc, prefix, valid = t["doc"], t["prefix"], t["valid"]

    def causal(b, h, q, kv):
        return q >= kv

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    return {
        "no_mask": None,
        "causal": causal,
        "sliding_window": lambda b, h, q, kv: (q >= kv) & (q - kv <= 5),
        "prefix_lm": lambda b, h, q, kv: (kv < 6) | (q >= kv),
        "prefix_per_batch": lambda b, h, q, kv: (kv < prefix[b]) | (q >= kv),
        "document": document,
        "document_causal": and_masks(causal, document),
        "composed": lambda b, h, q, kv: ~(q < kv) | ((kv % 7 == 0) ^ (h == 1)),
        "or_masks": or_masks(causal, lambda b, h, q, kv: kv < 3),
        "padding_bool_table": lambda b, h, q, kv: valid[b, kv] & (q >= kv),
    }


def captured_tensors(dtype):
    g = torch.Generator().manual_seed(1234)
    values = {
        "slopes": torch.rand(H, generator=g),
        "table": torch.randn(H, NQ + NK, generator=g),
        "t5_table": torch.randn(H, 32, generator=g),
        "c": torch.tensor(7.5),
        "w": torch.randn(5, generator=g),
    }
    t = {k: v.to(dtype).requires_grad_(k in ("table", "t5_table", "c", "w")) for k, v in values.items()}
    t["t64"] = torch.randn(H, NQ + NK, generator=g, dtype=torch.float64)  # these two keep their dtype
    t["tbf"] = torch.randn(H, NQ + NK, generator=g).to(torch.bfloat16)
    t["doc"] = torch.repeat_interleave(torch.arange(8, dtype=torch.int32), 5)[: max(NQ, NK)].contiguous()
    t["prefix"] = torch.tensor([3, 9])
    t["valid"] = torch.arange(NK)[None, :] < torch.tensor([[NK - 7], [NK]])
    return t


# ---------------------------------------------------------------------------------------------
# One kernel per traced function: evaluates the emitted expressions at every point.


def grid_kernel(name, traced, index_dtype="int32"):
    score = tirx.decl_buffer((POINTS,), "float32", "score")
    index = [tirx.decl_buffer((POINTS,), index_dtype, n) for n in ("b", "h", "q_idx", "kv_idx")]
    upstream = tirx.decl_buffer((POINTS,), "float32", "upstream")
    is_mask = not hasattr(traced, "emit_grad")
    out = tirx.decl_buffer((POINTS,), "bool" if is_mask else "float32", "out")
    dscore = tirx.decl_buffer((POINTS,), "float32", "dscore")
    buffers = traced.decl_buffers()
    grads = {c.name: c.decl_grad_buffer() for c in traced.captured if c.requires_grad}
    i = tirx.Var("i", "int32")
    at = [buf[i] for buf in index]
    if is_mask:
        stmts = [tirx.BufferStore(out, traced.emit(*at, buffers), [i])]
    else:
        stmts = [
            tirx.BufferStore(out, traced.emit(score[i], *at, buffers), [i]),
            tirx.BufferStore(dscore, traced.emit_grad(score[i], *at, buffers), [i]),
        ]
        for cname, idx, value in traced.emit_captured_grads(score[i], *at, upstream[i], buffers):
            acc = grads[cname]
            stmts.append(tirx.BufferStore(acc, tirx.BufferLoad(acc, idx) + value, idx))
    body = tirx.For(i, 0, POINTS, tirx.ForKind.SERIAL, stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts))
    params = [score, *index, upstream, out, dscore, *buffers.values(), *grads.values()]
    return tirx.PrimFunc(params, body).with_attr("global_symbol", name)


@pytest.fixture(scope="module")
def compiled():
    """All gallery functions traced and compiled into one module: {name: (traced, fn32, fn64)}."""
    t32, t64 = captured_tensors(torch.float32), captured_tensors(torch.float64)
    cases = {}
    for gallery in (score_gallery, mask_gallery):
        fn32, fn64 = gallery(t32), gallery(t64)
        for name in fn32:
            tracer = trace_score_mod if gallery is score_gallery else trace_mask_mod
            cases[name] = (tracer(fn32[name]), fn32[name], fn64[name])
    funcs = {name: grid_kernel(name, traced) for name, (traced, _, _) in cases.items()}
    for name in ("relative_bias", "document"):  # int64 index expressions in, too
        funcs[f"{name}_i64"] = grid_kernel(f"{name}_i64", cases[name][0], "int64")
    lib = tvm.compile(tvm.IRModule(funcs), target=host_target())
    return lib, cases, t32, t64


def random_points(gen, index_dtype=torch.int32):
    def draw(n):
        return torch.randint(0, n, (POINTS,), generator=gen, dtype=torch.int64).to(index_dtype)

    return draw(B), draw(H), draw(NQ), draw(NK)


def reference(fn, score64, b, h, q, kv):
    if fn is None:
        return score64
    return torch.vmap(fn)(score64, b, h, q, kv)


def run_score_case(lib, name, traced, index, score, upstream, index_dtype=torch.int32):
    out, dscore = torch.empty(POINTS), torch.empty(POINTS)
    caps = [c.tensor.detach().contiguous() for c in traced.captured]
    grads = [torch.zeros(c.shape) for c in traced.captured if c.requires_grad]
    lib[name](score, *(x.to(index_dtype) for x in index), upstream, out, dscore, *caps, *grads)
    return out, dscore, grads


SCORE_CASES = list(score_gallery(captured_tensors(torch.float32)))
MASK_CASES = list(mask_gallery(captured_tensors(torch.float32)))
EXACT = {"integer_math", "floor_division"}  # integer paths: must agree exactly with torch in float32


def close(ours, ref, what, rtol=2e-6, atol=2e-6, magnitude=None):
    ref = ref.double()
    ours = ours.double()
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), f"{what}: inf pattern differs"
    finite = torch.isfinite(ref)
    scale = ref.abs() if magnitude is None else magnitude
    err = (ours - ref).abs()[finite]
    bound = (atol + rtol * scale)[finite] if isinstance(scale, torch.Tensor) else atol + rtol * scale
    bad = err > bound
    assert not bad.any(), f"{what}: max error {err.max():.3g} (worst at {bad.nonzero()[:5].flatten().tolist()})"


@pytest.mark.parametrize("name", SCORE_CASES)
def test_score_mod_matches_torch(compiled, name, gen, seed):
    lib, cases, t32, t64 = compiled
    traced, fn32, fn64 = cases[name]
    b, h, q, kv = random_points(gen)
    score = torch.randn(POINTS, generator=gen) * 6
    upstream = torch.randn(POINTS, generator=gen)
    out, dscore, grads = run_score_case(lib, name, traced, (b, h, q, kv), score, upstream)

    if name in EXACT:  # same float32 arithmetic in torch: bit-exact but for the rounding mode of /
        ref32 = reference(fn32, score, b, h, q, kv)
        close(out, ref32, f"{name} (seed {seed})", rtol=1e-6, atol=1e-5)
    score64 = score.double().requires_grad_()
    ref = reference(fn64, score64, b, h, q, kv)
    close(out, ref.detach(), f"{name} value (seed {seed})", rtol=4e-6, atol=4e-6)

    (dref,) = torch.autograd.grad(ref.sum(), score64, allow_unused=True, retain_graph=True) if ref.requires_grad \
        else (None,)
    dref = torch.zeros(POINTS, dtype=torch.float64) if dref is None else dref
    # the flash-attn rule per point: a few ulps plus twice torch's own float32 error (a sum of
    # terms that cancel, e.g. sinh' + cosh' at negative scores, rounds at the terms' size)
    close(dscore, dref, f"{name} d/dscore (seed {seed})", rtol=4e-6, atol=4e-6 + 2 * _torch_float32_error(
        fn32, score, (b, h, q, kv), dref))

    grad_names = [c.name for c in traced.captured if c.requires_grad]
    if grad_names:
        wanted = [t64[k] for k in grad_names]
        refs = torch.autograd.grad(ref, wanted, upstream.double(), allow_unused=True)
        for cname, ours, r in zip(grad_names, grads, refs):
            r = torch.zeros_like(t64[cname]) if r is None else r
            # the scatter-add sums up to POINTS terms of size |upstream * d|
            close(ours, r, f"{name} grad of {cname} (seed {seed})", rtol=1e-5,
                  atol=1e-5 * float(upstream.abs().sum()))


def _torch_float32_error(fn32, score, index, dref) -> torch.Tensor:
    """|d/dscore of ``fn32`` by torch's autograd in float32 - dref|, per point (0 where torch's
    derivative is not finite or the function ignores the score)."""
    if fn32 is None:
        return torch.zeros(POINTS, dtype=torch.float64)
    score32 = score.clone().requires_grad_()
    out32 = reference(fn32, score32, *index)
    if not out32.requires_grad:
        return torch.zeros(POINTS, dtype=torch.float64)
    (d32,) = torch.autograd.grad(out32.sum(), score32, allow_unused=True)
    if d32 is None:
        return torch.zeros(POINTS, dtype=torch.float64)
    return (d32.double() - dref).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)


@pytest.mark.parametrize("name", MASK_CASES)
def test_mask_mod_matches_torch(compiled, name, gen):
    lib, cases, t32, _ = compiled
    traced, fn32, _ = cases[name]
    b, h, q, kv = random_points(gen)
    out = torch.empty(POINTS, dtype=torch.bool)
    caps = [c.tensor.contiguous() for c in traced.captured]
    dummy = torch.empty(POINTS)
    lib[name](dummy, b, h, q, kv, dummy, out, dummy, *caps)
    ref = torch.ones(POINTS, dtype=torch.bool) if fn32 is None else torch.vmap(fn32)(b, h, q, kv)
    assert torch.equal(out, ref), f"{name}: {(out != ref).sum()} of {POINTS} points differ"


def test_int64_index_expressions(compiled, gen):
    lib, cases, _, _ = compiled
    b, h, q, kv = random_points(gen, torch.int64)
    score, upstream = torch.randn(POINTS, generator=gen), torch.randn(POINTS, generator=gen)
    traced = cases["relative_bias"][0]
    out32 = run_score_case(lib, "relative_bias", traced, (b, h, q, kv), score, upstream)
    out64 = run_score_case(lib, "relative_bias_i64", traced, (b, h, q, kv), score, upstream, torch.int64)
    assert all(torch.equal(x, y) for x, y in zip(out32[:2] + tuple(out32[2]), out64[:2] + tuple(out64[2])))
    out = torch.empty(POINTS, dtype=torch.bool)
    dummy = torch.empty(POINTS)
    lib["document_i64"](dummy, b, h, q, kv, dummy, out, dummy, cases["document"][0].captured[0].tensor)
    assert torch.equal(out, torch.vmap(cases["document"][1])(b, h, q, kv))


def test_captured_tensors_found_named_and_ordered(compiled):
    _, cases, t32, _ = compiled
    caps = cases["relative_bias_nested"][0].captured
    assert [(c.name, c.shape, c.dtype, c.requires_grad) for c in caps] == [("table", (H, NQ + NK), "float32", True)]
    assert caps[0].tensor is t32["table"]  # the user's tensor itself: its current values at every call
    assert [c.name for c in cases["learnable_softcap"][0].captured] == ["c"]  # 0-d but learnable: a buffer
    assert cases["casts"][0].captured == []  # 0-d constant tensor without grad: inlined
    assert [c.name for c in cases["padding_bool_table"][0].captured] == ["valid"]
    assert cases["padding_bool_table"][0].captured[0].dtype == "bool"
    assert [c.name for c in cases["document_causal"][0].captured] == ["doc"]  # found through and_masks

    a, w = torch.rand(3), torch.rand(3)
    traced = trace_score_mod(lambda s, b, h, q, kv: s * w[h] + a[h] + w[q])  # order of first use
    assert [c.name for c in traced.captured] == ["w", "a"]

    class RelativeBias(torch.nn.Module):  # a module as score_mod: its parameters and buffers
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(H, 65))
            self.register_buffer("slopes", torch.rand(H))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score + self.bias[h, q_idx - kv_idx + 32] + self.slopes[h] * (kv_idx - q_idx)

    traced = trace_score_mod(RelativeBias())
    assert [(c.name, c.requires_grad) for c in traced.captured] == [("bias", True), ("slopes", False)]


def test_gradient_terms(compiled):
    """The scatter-add terms: one per read of a learnable tensor; 0-d learnable: an empty index."""
    _, cases, _, _ = compiled
    s, g = tirx.Var("s", "float32"), tirx.Var("g", "float32")
    idx = [tirx.Var(n, "int32") for n in ("b", "h", "q", "kv")]
    nested = cases["relative_bias_nested"][0]
    terms = nested.emit_captured_grads(s, *idx, g, nested.decl_buffers())
    assert len(terms) == 2 and {t[0] for t in terms} == {"table"} and all(len(t[1]) == 2 for t in terms)
    cap = cases["learnable_softcap"][0]
    ((name, index, _),) = cap.emit_captured_grads(s, *idx, g, cap.decl_buffers())
    assert (name, list(index)) == ("c", [])
    assert cases["alibi"][0].emit_captured_grads(s, *idx, g, cases["alibi"][0].decl_buffers()) == []


def test_intrinsics_can_be_substituted(compiled):
    """The kernel engineer swaps in fast vectorizable versions per call (or edits INTRINSICS)."""
    traced = compiled[1]["softcap"][0]
    s, idx = tirx.Var("s", "float32"), [tirx.Var(n, "int32") for n in "bhqk"]
    assert "tanh" in str(traced.emit(s, *idx))
    fast = {"tanh": lambda x: x / (tirx.const(1.0, "float32") + tirx.abs(x))}
    for expr in (traced.emit(s, *idx, intrinsics=fast), traced.emit_grad(s, *idx, intrinsics=fast)):
        assert "tanh" not in str(expr)


def test_out_of_range_indices_are_clamped():
    """torch raises IndexError; the kernel clamps into range (negative indices wrap first)."""
    table = torch.randn(H, 8)
    traced = trace_score_mod(lambda s, b, h, q, kv: s + table[h, q - kv + 100] + table[h, -1 - kv])
    lib = tvm.compile(tvm.IRModule({"f": grid_kernel("f", traced)}), target=host_target())
    gen = torch.Generator().manual_seed(0)
    b, h, q, kv = random_points(gen)
    score = torch.randn(POINTS, generator=gen)
    out, _, _ = run_score_case(lib, "f", traced, (b, h, q, kv), score, torch.ones(POINTS))
    first = (q - kv + 100).clamp(0, 7).long()
    second = torch.where(-1 - kv < 0, -1 - kv + 8, -1 - kv).clamp(0, 7).long()
    assert torch.equal(out, score + table[h.long(), first] + table[h.long(), second])


def test_dense_reference_helpers(gen):
    t = captured_tensors(torch.float64)
    scores = torch.randn(B, H, NQ, NK, dtype=torch.float64, generator=gen, requires_grad=True)
    idx = torch.meshgrid(*(torch.arange(n, dtype=torch.int32) for n in (B, H, NQ, NK)), indexing="ij")
    for name, fn in score_gallery(t).items():
        dense = apply_score_mod_dense(fn, scores)
        flat = reference(fn, scores.reshape(-1), *(i.reshape(-1) for i in idx)).reshape(dense.shape)
        assert torch.equal(dense, flat), name
    dense = apply_score_mod_dense(score_gallery(t)["relative_bias"], scores)
    dense.sum().backward()  # differentiable, captured tensors included
    assert t["table"].grad is not None and scores.grad is not None

    from torch.nn.attention.flex_attention import create_mask

    for name, fn in mask_gallery(t).items():
        ours = dense_mask(fn, B, H, NQ, NK)
        assert ours.shape == (B, H, NQ, NK) and ours.dtype == torch.bool
        if fn is not None:
            assert torch.equal(ours, create_mask(fn, B, H, NQ, NK, device="cpu")), name


# ---------------------------------------------------------------------------------------------
# Keys


def test_keys_are_stable_and_distinguish_constants():
    def softcap(cap):
        return lambda s, b, h, q, kv: cap * torch.tanh(s / cap)

    assert trace_score_mod(softcap(20.0)).key == trace_score_mod(softcap(20.0)).key
    assert trace_score_mod(softcap(20.0)).key != trace_score_mod(softcap(30.0)).key

    def scaled(c):
        return lambda s, b, h, q, kv: s * c

    assert trace_score_mod(scaled(torch.tensor(0.5))).key != trace_score_mod(scaled(torch.tensor(0.25))).key

    def biased(t):
        return lambda s, b, h, q, kv: s + t[h]

    base = trace_score_mod(biased(torch.zeros(4))).key
    assert base == trace_score_mod(biased(torch.ones(4))).key  # values are buffer contents, not code
    assert base != trace_score_mod(biased(torch.zeros(5))).key
    assert base != trace_score_mod(biased(torch.zeros(4, dtype=torch.float64))).key
    assert base != trace_score_mod(biased(torch.zeros(4, requires_grad=True))).key
    assert trace_mask_mod(lambda b, h, q, kv: q >= kv).key != trace_mask_mod(lambda b, h, q, kv: q > kv).key
    assert trace_mask_mod(None).key != trace_mask_mod(lambda b, h, q, kv: q >= kv).key


SCRIPT = textwrap.dedent("""
    import torch
    from tvmflash.flex_trace import trace_score_mod, trace_mask_mod
    slopes = torch.exp2(-torch.arange(1, 9, dtype=torch.float32))
    table = torch.zeros(8, 65, requires_grad=True)
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx) + table[h, q_idx - kv_idx + 32]
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    print(trace_score_mod(alibi).key, trace_mask_mod(causal).key)
""")


def test_keys_are_the_same_in_another_process():
    namespace = {}
    exec(SCRIPT.replace("print(", "result = ("), namespace)  # noqa: S102 - the same source, in this process
    here = " ".join(namespace["result"])
    there = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there


# ---------------------------------------------------------------------------------------------
# Errors


def _raises(match, fn, tracer=trace_score_mod):
    with pytest.raises(FlexTraceError, match=match):
        tracer(fn)


def test_error_unsupported_op_names_it():
    def cumulative(s, b, h, q, kv):
        return torch.cumsum(s.unsqueeze(0), 0)[0]

    with pytest.raises(FlexTraceError, match=r"score_mod uses aten\.cumsum, which tvmflash cannot translate") as info:
        trace_score_mod(cumulative)
    assert "test_flex_trace.py" in str(info.value) and "torch.cumsum" in str(info.value)  # the user's line
    assert "supported: aten.abs, aten.acos, aten.add" in str(info.value) and "aten.tanh_backward" in str(info.value)
    assert "aten.cumsum" not in supported_ops()


def test_error_data_dependent_control_flow():
    def branchy(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return -score

    with pytest.raises(FlexTraceError, match=r"torch\.where") as info:
        trace_score_mod(branchy)
    assert "`if score > 0:`" in str(info.value) and "test_flex_trace.py" in str(info.value)
    _raises(r"needs the value of a tensor.*torch\.where", lambda s, b, h, q, kv: s + float(q))
    _raises(r"needs the value of a tensor", lambda b, h, q, kv: q >= kv and q - kv < 4, trace_mask_mod)


def test_error_python_containers_are_not_tensors():
    documents = [0, 0, 1, 1, 2]
    _raises(r"indexes `documents`, a Python list, with a tensor.*torch\.tensor\(documents\)",
            lambda b, h, q, kv: documents[q] == documents[kv], trace_mask_mod)


def test_error_wrong_return_shape():
    table = torch.zeros(H, 33)
    _raises(r"one value per \(b, h, q_idx, kv_idx\).*returned shape \(33,\)", lambda s, b, h, q, kv: s + table[h])


def test_error_wrong_return_dtype():
    _raises(r"score_mod must return a floating-point score, but it returned torch\.int32",
            lambda s, b, h, q, kv: q - kv)
    _raises(r"score_mod must return a floating-point score, but it returned torch\.bool",
            lambda s, b, h, q, kv: q >= kv)
    _raises(r"mask_mod must return a bool tensor \(True = attend\), but it returned torch\.float32",
            lambda b, h, q, kv: (q >= kv).float(), trace_mask_mod)
    _raises(r"mask_mod must return a tensor, but it returned the Python value True",
            lambda b, h, q, kv: True, trace_mask_mod)


def test_error_captured_tensor_on_another_device():
    slopes = torch.zeros(H, device="meta")
    _raises(r"captures `slopes` on device meta, but the kernels run on cpu", lambda s, b, h, q, kv: s + slopes[h])
    if torch.cuda.is_available():
        on_gpu = torch.zeros(H, device="cuda")
        _raises(r"captures `on_gpu` on device cuda", lambda s, b, h, q, kv: s + on_gpu[h])


def test_error_captured_tensor_not_of_real_numbers():
    phases = torch.zeros(H, dtype=torch.complex64)
    _raises(r"captures `phases` of dtype torch\.complex64; captured tensors must hold real numbers",
            lambda s, b, h, q, kv: s + phases[h].real)


def test_error_wrong_arity_and_type():
    _raises(r"must take 5 positional arguments.*takes 4; it looks like a mask_mod", lambda b, h, q, kv: q >= kv)
    _raises(r"must take 4 positional arguments.*takes 5", lambda s, b, h, q, kv: s, trace_mask_mod)
    _raises(r"must be a function", 3.0)


def test_error_constant_index_out_of_range():
    table = torch.zeros(H, 8)
    _raises(r"index 9 is out of range for a dimension of size 8", lambda s, b, h, q, kv: s + table[h, 9])


def test_error_emit_with_wrong_buffers():
    slopes = torch.zeros(H)
    traced = trace_score_mod(lambda s, b, h, q, kv: s + slopes[h])
    s, idx = tirx.Var("s", "float32"), [tirx.Var(n, "int32") for n in "bhqk"]
    with pytest.raises(FlexTraceError, match=r"no buffer for captured tensor `slopes`"):
        traced.emit(s, *idx, {})
    with pytest.raises(FlexTraceError, match=r"has dtype float16, the captured tensor float32"):
        traced.emit(s, *idx, {"slopes": tirx.decl_buffer((H,), "float16", "slopes")})


# ---------------------------------------------------------------------------------------------
# Edge cases where torch's decompositions (tvmflash.flex_trace.ops.DECOMPOSITIONS) now define the
# emitted math: special scores (NaN, +-inf, huge, tiny), integer/bool promotion through the
# decomposed ops, and clamped reads of captured tensors (with their gradients) behind decomposed
# ops. Every (b, h, q_idx, kv_idx) of the grid, against the dense reference in float64, with
# the default intrinsics and with the kernels' polynomial exp/exp2/tanh/sigmoid.

SPECIAL_SCORES = (-math.inf, math.inf, math.nan, 0.0, -0.0, 1e30, -1e30, 88.0, -88.0, 1e-30, 7.0, -7.0)


def edge_gallery(t, traced: bool):
    """name -> score_mod; ``traced=False``: the reference form (out-of-range indices clamped by
    hand: torch raises where the kernels clamp)."""
    table, slopes = t["table"], t["slopes"]
    last = table.shape[1] - 1

    def read(i):  # negative indices wrap (as in torch), then out-of-range ones clamp
        return i if traced else torch.where(i < 0, i + last + 1, i).clamp(0, last)

    F = torch.nn.functional
    return {
        "special_activations": lambda s, b, h, q, kv: (
            F.silu(s) + F.softplus(s, beta=2, threshold=5) + F.leaky_relu(s, 0.1) + F.gelu(s) * 0.5 + torch.sigmoid(s)
        ),
        "special_tanh": lambda s, b, h, q, kv: F.gelu(s, approximate="tanh") * 0.25 + torch.tanh(s),
        "special_nan_inf": lambda s, b, h, q, kv: (
            torch.logaddexp(s, -s) + torch.logaddexp(s, s * 0.5)
            + torch.nan_to_num(s, nan=-3.0, posinf=5.0, neginf=-5.0)
            + torch.where(torch.isposinf(s) | torch.isneginf(s), 1.0, 0.0)
            + torch.lerp(s, s * 2, 0.75) + torch.lerp(s, -s, 0.25) + torch.clamp_min(s, -1) + torch.clamp_max(s, 1)
        ),
        "masked_fill_inf": lambda s, b, h, q, kv: torch.logaddexp(s.masked_fill(q < kv, -math.inf), s * 0.5),
        "promotion": lambda s, b, h, q, kv: (
            s + (q - kv).clamp_min(0) + (q > kv) * s + torch.where(q > kv, q - kv, 0.5)
            + (q - kv).masked_fill(q > kv, 2.5) + torch.floor_divide(q - kv, -3) + (1 - (q > kv).int())
            + torch.rsub(q - kv, 2) * 0.5 + (kv - q).to(s.dtype).frac() + torch.lerp(s, (q - kv).to(s.dtype), 0.6)
            + torch.zeros_like(q) + torch.ones_like(s) * torch.sgn(q - kv)
        ),
        "clamped_reads": lambda s, b, h, q, kv: (
            torch.where(q >= kv, table[h, read(q - kv + 100)], -math.inf) + F.silu(table[h, read(kv - q - 70)])
            + torch.lerp(s, table[h, read(q - kv + NK)], slopes[h]) + torch.logaddexp(s, table[-1, read(q - 3)])
        ),
    }


EDGE_CASES = [(name, kind) for name in edge_gallery(captured_tensors(torch.float32), True) for kind in ("libm", "fast")]


def points_kernel(name, traced, n, intrinsics):
    score, upstream = (tirx.decl_buffer((n,), "float32", k) for k in ("score", "upstream"))
    index = [tirx.decl_buffer((n,), "int32", k) for k in ("b", "h", "q_idx", "kv_idx")]
    out, dscore = (tirx.decl_buffer((n,), "float32", k) for k in ("out", "dscore"))
    buffers = traced.decl_buffers()
    grads = {c.name: c.decl_grad_buffer() for c in traced.captured if c.requires_grad}
    i = tirx.Var("i", "int32")
    at = [buf[i] for buf in index]
    stmts = [tirx.BufferStore(out, traced.emit(score[i], *at, buffers, intrinsics=intrinsics), [i]),
             tirx.BufferStore(dscore, traced.emit_grad(score[i], *at, buffers, intrinsics=intrinsics), [i])]
    for cname, idx, value in traced.emit_captured_grads(score[i], *at, upstream[i], buffers, intrinsics=intrinsics):
        stmts.append(tirx.BufferStore(grads[cname], tirx.BufferLoad(grads[cname], idx) + value, idx))
    body = tirx.For(i, 0, n, tirx.ForKind.SERIAL, tirx.SeqStmt(stmts))
    params = [score, *index, upstream, out, dscore, *buffers.values(), *grads.values()]
    return tirx.PrimFunc(params, body).with_attr("global_symbol", name)


@pytest.fixture(scope="module")
def compiled_edges():
    from tvmflash.score_mods import FAST_INTRINSICS

    t32 = captured_tensors(torch.float32)
    traced = {name: trace_score_mod(fn) for name, fn in edge_gallery(t32, True).items()}
    n = B * H * NQ * NK
    funcs = {f"{name}_{kind}": points_kernel(f"{name}_{kind}", tr, n, table)
             for name, tr in traced.items() for kind, table in (("libm", None), ("fast", FAST_INTRINSICS))}
    return tvm.compile(tvm.IRModule(funcs), target=host_target()), traced


def same_specials(ours, ref, what, ref64=None):
    """NaN/+-inf where torch's float32 has them, except where float32 torch gives NaN for an
    infinite float64 value (torch 2.13's vectorized fp32 gelu(+inf) is NaN): ours must be that inf."""
    ours, ref = ours.double(), ref.double()
    if ref64 is not None:
        ref = torch.where(torch.isnan(ref) & torch.isinf(ref64.double()), ref64.double(), ref)
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        bad = test(ours) != test(ref)
        assert not bad.any(), f"{what}: {test.__name__} differs at {bad.sum()} points, e.g. ours " \
            f"{ours[bad][:4].tolist()} vs torch {ref[bad][:4].tolist()}"


@pytest.mark.parametrize(("name", "kind"), EDGE_CASES)
def test_decomposed_edge_cases_match_dense_float64(compiled_edges, name, kind, gen):
    """NaN and +-inf where torch computes them in float32 (the kernels' dtype: 1e30 * 1e30
    overflows there); every finite value against float64."""
    lib, traced = compiled_edges
    tr = traced[name]
    n = B * H * NQ * NK
    score = torch.randn(n, generator=gen) * 6
    special = torch.randint(0, 3, (n,), generator=gen) == 0
    pick = torch.randint(0, len(SPECIAL_SCORES), (int(special.sum()),), generator=gen)
    score[special] = torch.tensor(SPECIAL_SCORES)[pick]
    upstream = torch.randn(n, generator=gen)
    index = [i.reshape(-1).contiguous() for i in
             torch.meshgrid(*(torch.arange(k, dtype=torch.int32) for k in (B, H, NQ, NK)), indexing="ij")]
    tensors = {dtype: captured_tensors(dtype) for dtype in (torch.float32, torch.float64)}
    out, dscore = torch.full((n,), 1234.5), torch.full((n,), 1234.5)  # poisoned
    grads = [torch.zeros(c.shape) for c in tr.captured if c.requires_grad]
    caps = [tensors[torch.float32][c.name].detach() for c in tr.captured]
    lib[f"{name}_{kind}"](score, *index, upstream, out, dscore, *caps, *grads)

    learnable = [c.name for c in tr.captured if c.requires_grad]
    refs = {}
    for dtype, t in tensors.items():  # value, d/dscore, captured grads; flat
        scores = score.to(dtype).reshape(B, H, NQ, NK).requires_grad_()
        value = apply_score_mod_dense(edge_gallery(t, False)[name], scores)
        up = upstream.to(dtype).reshape(value.shape)
        dvalue = torch.autograd.grad(value, [scores] + [t[k] for k in learnable], up, allow_unused=True)
        dvalue = [torch.zeros_like(x) if g is None else g for x, g in zip([scores] + [t[k] for k in learnable], dvalue)]
        refs[dtype] = [value.detach().reshape(-1), dvalue[0].reshape(-1) / up.reshape(-1), *dvalue[1:]]
    for what, ours, r32, r64 in zip(["value", "d/dscore", *(f"grad of {k}" for k in learnable)], [out, dscore, *grads],
                                    refs[torch.float32], refs[torch.float64]):
        same_specials(ours, r32, f"{name} {what}", r64)
        finite = torch.isfinite(r32)
        atol = 1e-5 * float(upstream.abs().sum()) if what.startswith("grad") else 4e-6
        close(ours[finite], r64[finite], f"{name} {what}", rtol=1e-5, atol=atol)
