"""flex_attention: score_mod / mask_mod fused into the forward and backward kernels, against a
dense float64 reference (the same functions applied to materialised scores, torch autograd),
by the flash-attn rule; block sparsity; captured tensors and their gradients; torch.compile,
opcheck; clear errors."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from conftest import DTYPES, assert_flash_rule
from tvmflash import create_block_mask, flex_attention, flex_trace
from tvmflash.flex import tile_maps
from tvmflash.reference import reference_attention


def _randint(gen, lo, hi):
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _check(gen, seed, *, dtype="float32", head_dim=64, heads=4, heads_k=2, seqlen_q=None, seqlen_k=None,
           score_mod=None, mask_mod=None, captured=(), lse_grad=False, tag=""):
    """flex_attention(q, k, v) and its gradients (q, k, v and captured tensors requiring grad) vs
    float64 by the flash-attn rule. ``captured``: (name, tensor) the functions close over; they
    are recreated in float64 for the reference through ``rebuild(**tensors)``. ``lse_grad``:
    the gradients of a loss of out and lse (torch's lse is differentiable)."""
    batch = _randint(gen, 1, 2)
    seqlen_q = seqlen_q or _randint(gen, 70, 260)
    seqlen_k = seqlen_k or _randint(gen, 70, 260)
    torch_dtype = DTYPES[dtype]
    q = torch.randn(batch, heads, seqlen_q, head_dim, generator=gen).to(torch_dtype).requires_grad_()
    k, v = (torch.randn(batch, heads_k, seqlen_k, head_dim, generator=gen).to(torch_dtype).requires_grad_()
            for _ in range(2))
    dout = torch.randn(q.shape, generator=gen).to(torch_dtype)
    dlse = torch.randn(q.shape[:3], generator=gen) * 4 if lse_grad else None
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, seqlen_q, seqlen_k)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=heads != heads_k,
                              return_lse=True)
    trainable = [t for _, t in captured if t.requires_grad]
    grads = torch.autograd.grad((out, lse) if lse_grad else out, (q, k, v, *trainable),
                                (dout, dlse) if lse_grad else dout)
    assert out.shape == q.shape and out.dtype == torch_dtype and lse.shape == (batch, heads, seqlen_q)

    mask = None if mask_mod is None else flex_trace.dense_mask(mask_mod, batch, heads, seqlen_q, seqlen_k)
    results = {}
    for ref_dtype in (torch.float64, torch_dtype):
        leaves = [t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v)]
        extra = [t.detach().to(ref_dtype).requires_grad_() for t in trainable]
        ref_out, ref_lse = reference_attention(*(t.transpose(1, 2) for t in leaves), score_mod=_with(score_mod, captured, extra),
                                               mask=mask, dtype=ref_dtype)
        ref_out = ref_out.transpose(1, 2)
        finite_lse = ref_lse.masked_fill(~torch.isfinite(ref_lse), 0)  # (rows that see no key: no gradient)
        ref_grads = torch.autograd.grad((ref_out, finite_lse) if lse_grad else ref_out, leaves + extra,
                                        (dout.to(ref_dtype), dlse.to(finite_lse.dtype)) if lse_grad else
                                        dout.to(ref_dtype), allow_unused=True)
        results[ref_dtype] = [ref_out, ref_lse, *ref_grads]
    names = ["out", "lse", "dq", "dk", "dv", *(f"d{n}" for n, t in captured if t.requires_grad)]
    sees_a_key = torch.isfinite(results[torch.float64][1])
    for i, (name, ours) in enumerate(zip(names, [out, lse, *grads])):
        f64, same = results[torch.float64][i].detach(), results[torch_dtype][i]
        same = f64 if same is None else same.detach()
        if name == "lse":
            assert torch.equal(torch.isfinite(ours), sees_a_key), f"{tag}: -inf rows differ"
            ours, f64, same = ours[sees_a_key], f64[sees_a_key], same[sees_a_key]
            if ours.numel() == 0:
                continue
            assert_flash_rule(f"{tag} lse", ours, f64, same.float(), torch.float32, seed, ulps=8)
            continue
        if name in ("out", "dq"):  # rows that see no key: exactly 0
            blind = ~sees_a_key[..., None]
            assert torch.all(ours.masked_select(blind) == 0), f"{tag} {name}: rows without keys are not 0"
        # accumulations over many terms: ulps of the largest term's size
        magnitude = float(f64.abs().max()) * (16 if name.startswith("d") else 1) + 1
        assert_flash_rule(f"{tag} {name}", ours.float() if name not in ("out", "dq", "dk", "dv") else ours, f64,
                          same if name in ("out", "dq", "dk", "dv") else same.float(),
                          torch_dtype if name in ("out", "dq", "dk", "dv") else torch.float32, seed,
                          ulps=16, magnitude=magnitude)


def _with(score_mod, captured, replacements):
    """score_mod for the reference: the same function, its trainable captured tensors swapped
    for float64 leaves (the function reads them through the module-level dict ``LIVE``)."""
    if score_mod is None:
        return None
    trainable = [n for n, t in captured if t.requires_grad]

    def ref_mod(s, b, h, i, j):
        saved = {n: LIVE[n] for n in trainable}
        LIVE.update(dict(zip(trainable, replacements)))
        try:
            return score_mod(s, b, h, i, j)
        finally:
            LIVE.update(saved)

    return ref_mod


LIVE: dict[str, torch.Tensor] = {}


# --- masks -------------------------------------------------------------------------------------
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_causal_and_sliding_windows(gen, seed):
    _check(gen, seed, mask_mod=causal, tag="causal")
    left, right = _randint(gen, 1, 90), _randint(gen, 0, 40)

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)

    _check(gen, seed, mask_mod=window, tag=f"window ({left}, {right})")


def test_document_mask_with_random_boundaries(gen, seed):
    n = _randint(gen, 150, 300)
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: _randint(gen, 1, 6)].add(1).tolist())
    document = torch.zeros(n, dtype=torch.int32)
    for c in cuts:
        document[c:] += 1

    def same_document(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    _check(gen, seed, seqlen_q=n, seqlen_k=n, mask_mod=same_document, tag=f"documents {cuts}")


def test_prefix_lm(gen, seed):
    prefix = _randint(gen, 1, 100)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    _check(gen, seed, mask_mod=prefix_lm, tag=f"prefix {prefix}")


def test_fully_masked_rows_give_zero_output_and_gradients(gen, seed):
    """Queries past the key length see nothing (q_idx < 40 sees no key here)."""
    def late_keys(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx - 40

    _check(gen, seed, seqlen_q=150, seqlen_k=150, mask_mod=late_keys, tag="blind rows")


# --- score mods ----------------------------------------------------------------------------------
def test_softcap_and_alibi(gen, seed):
    cap = 12.0
    slopes = torch.rand(4, generator=gen) * 0.5
    LIVE["slopes"] = slopes

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + LIVE["slopes"][h] * (kv_idx - q_idx)

    _check(gen, seed, score_mod=softcap, mask_mod=causal, tag="softcap")
    _check(gen, seed, score_mod=alibi, captured=[("slopes", slopes)], tag="alibi")


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "learnable"])
def test_relative_position_bias_table(gen, seed, trainable):
    """score + bias[h, q_idx - kv_idx + 300]: a learnable table gets its gradient (scatter-add)."""
    table = (torch.randn(4, 600, generator=gen) * 0.5).requires_grad_(trainable)
    LIVE["table"] = table

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + LIVE["table"][h, q_idx - kv_idx + 300]

    _check(gen, seed, score_mod=relative_bias, captured=[("table", table)], tag=f"bias table ({trainable})")


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 64), ("float32", 32), ("bfloat16", 128), ("float32", 256)])
def test_dtypes_and_head_dims(gen, seed, dtype, head_dim):
    def tanh_mod(score, b, h, q_idx, kv_idx):
        return 20 * torch.tanh(score / 20)

    _check(gen, seed, dtype=dtype, head_dim=head_dim, score_mod=tanh_mod, mask_mod=causal,
           tag=f"{dtype} d={head_dim}")


@pytest.mark.parametrize("dtype,head_dim", [("float32", 32), ("bfloat16", 64), ("float32", 248)])
def test_lse_is_differentiable(gen, seed, dtype, head_dim):
    """As in torch's flex_attention: a loss of out and lse (a learnable bias, GQA, rows that see
    no key, up to the largest head dim whose kernels have two spare columns), and lse alone."""
    table = (torch.randn(4, 600, generator=gen) * 0.5).requires_grad_()
    LIVE["table"] = table

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + LIVE["table"][h, q_idx - kv_idx + 300]

    def late_keys(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx - 40

    _check(gen, seed, dtype=dtype, head_dim=head_dim, score_mod=relative_bias, captured=[("table", table)],
           mask_mod=late_keys, seqlen_q=150, seqlen_k=150, lse_grad=True, tag=f"lse gradient {dtype} d={head_dim}")
    q, k, v = (torch.randn(1, 2, 37, 32, generator=gen).requires_grad_() for _ in range(3))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference_attention(*(t.transpose(1, 2) for t in leaves))[1].sum(), leaves,
                               allow_unused=True)
    got = torch.autograd.grad(flex_attention(q, k, v, return_lse=True)[1].sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), torch.zeros_like(g.double()) if w is None else w, atol=1e-5, rtol=1e-5)


def test_lse_gradient_past_the_largest_head_dim_is_refused():
    q = torch.randn(1, 1, 16, 256, requires_grad=True)
    out, lse = flex_attention(q, q, q, return_lse=True)
    with pytest.raises(NotImplementedError, match="head_dim [+] 2 <= 256"):
        lse.sum().backward()


def test_mqa(gen, seed):
    _check(gen, seed, heads=6, heads_k=1, mask_mod=causal, tag="mqa")


# --- block sparsity ------------------------------------------------------------------------------
def _dense_states(mask_mod, seqlen_q, seqlen_k, tile):
    dense = flex_trace.dense_mask(mask_mod, 1, 1, seqlen_q, seqlen_k)[0, 0]
    states = []
    for q0 in range(0, seqlen_q, tile):
        row = []
        for k0 in range(0, seqlen_k, tile):
            part = dense[q0:q0 + tile, k0:k0 + tile]
            row.append(0 if not part.any() else 2 if part.all() and part.shape == (tile, tile) else 1)
        states.append(row)
    return torch.tensor(states, dtype=torch.int8)


def test_tile_maps_match_the_mask(gen):
    n = 1000

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 300)

    mask = create_block_mask(window, None, None, n, n)
    states, ranges = tile_maps(mask, n, n, 64, 64)
    expected = _dense_states(window, n, n, 64)
    # a tile inside a partial 128-block may itself be full or empty: never claim more than the mask
    assert torch.all((states[0, 0] == 0) <= (expected == 0)) and torch.all((states[0, 0] == 2) <= (expected == 2))
    assert torch.all((expected == 1) <= (states[0, 0] == 1))
    first, end = ranges[0, 0, :, 0], ranges[0, 0, :, 1]
    nonempty = states[0, 0] != 0
    for t in range(states.shape[2]):
        keys = torch.nonzero(nonempty[t]).flatten()
        assert (int(first[t]), int(end[t])) == ((int(keys[0]), int(keys[-1]) + 1) if len(keys) else (first[t], end[t]))


def test_tiles_the_block_mask_leaves_empty_or_full_follow_it(gen):
    """torch's semantics: an empty block is skipped, a full block skips mask_mod. A block mask
    that disagrees with its mask_mod on purpose shows both (the kernels follow the block mask)."""
    from torch.nn.attention.flex_attention import BlockMask

    n = 256  # 2 x 2 blocks of 128
    q, k, v = (torch.randn(1, 1, n, 32, generator=gen) for _ in range(3))

    def nothing_allowed(b, h, q_idx, kv_idx):
        return q_idx < 0

    # block (0, 0) full (mask_mod never evaluated: attends everywhere), (1, 1) partial (mask_mod:
    # nothing), the rest empty (skipped)
    kv_num = torch.tensor([[[0, 1]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 0], [1, 0]]]], dtype=torch.int32)
    full_num = torch.tensor([[[1, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 0], [0, 0]]]], dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=128, mask_mod=nothing_allowed,
                                    seq_lengths=(n, n))
    out = flex_attention(q, k, v, block_mask=mask)
    dense = torch.zeros(n, n, dtype=torch.bool)
    dense[:128, :128] = True
    ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), mask=dense)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=1e-6, rtol=0)
    assert torch.all(out[0, 0, 128:] == 0)


def test_agrees_with_torchs_own_flex_attention_forward(gen):
    """torch's flex_attention (forward only on CPU) as a second oracle."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    q, k, v = (torch.randn(2, 4, 200, 64, generator=gen) for _ in range(3))
    bias = torch.randn(4, 400, generator=gen)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 200]

    mask = create_block_mask(causal, None, None, 200, 200)
    ours, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True)
    theirs, their_lse = torch_flex(q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse, their_lse, atol=2e-5, rtol=0)
    from torch.nn.attention.flex_attention import AuxRequest

    out_aux, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, return_aux=AuxRequest(lse=True))
    assert torch.equal(out_aux, ours) and torch.equal(aux.lse, lse) and aux.max_scores is None


# --- integration ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,transposed", [("aot_eager", False), ("inductor", False), ("inductor", True)])
def test_torch_compile_fullgraph(gen, backend, transposed):
    """The whole call compiles into one graph: tracing the mods and compiling the kernels happen
    once while dynamo traces; captured tensors are graph inputs read on every call (a trainable
    bias gets its gradient), the tile maps are tensor code. ``transposed``: q, k, v as models
    make them, (B, N, H, D) storage seen as (B, H, N, D) (the fake kernels once gave such inputs'
    strides to the outputs, which the op returns contiguous: compiling failed)."""
    if transposed:
        q, k, v = (torch.randn(1, 100, 2, 32, generator=gen).transpose(1, 2).requires_grad_() for _ in range(3))
    else:
        q, k, v = (torch.randn(1, 2, 100, 32, generator=gen).requires_grad_() for _ in range(3))
    mask = create_block_mask(causal, None, None, 100, 100)
    bias = torch.randn(2, generator=gen).requires_grad_()
    LIVE["scale"] = torch.rand(2, generator=gen)

    def score_mod(s, b, h, i, j):
        return s * LIVE["scale"][h] + bias[h]

    def loss(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask).square().sum()

    compiled = torch.compile(loss, backend=backend, fullgraph=True)
    for _ in range(2):  # a changed captured tensor is read, not baked in
        eager = torch.autograd.grad(loss(q, k, v), (q, k, v, bias))
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v, bias))
        for a, b in zip(got, eager):
            torch.testing.assert_close(a, b)
        LIVE["scale"] = LIVE["scale"] + 1


def test_opcheck(gen):
    from tvmflash.flex import _flex_forward, _register_spec, _traced
    from tvmflash.spec import AttentionSpec

    bias = torch.randn(2, 64, generator=gen, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    traced = _traced("score_mod", score_mod)
    spec_key = _register_spec(AttentionSpec(32, "float32", score_mods=(traced,)))
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen, requires_grad=True) for _ in range(3))
    torch.library.opcheck(_flex_forward, (q, k, v, [bias], None, None, 0.2, spec_key))


@pytest.mark.parametrize("score_mod,match", [
    (lambda s, b, h, q, k: torch.cumsum(s.reshape(1), 0)[0], "aten.cumsum"),
    (lambda s, b, h, q, k: s if s > 0 else -s, "torch.where"),
    (lambda s, b, h, q, k: (s > 0), "floating-point score"),
    (lambda s, b, h, q, k: (s * 2, 3), "one tensor"),  # dynamo's graph holds only s * 2
])
def test_clear_errors(score_mod, match):
    q = torch.randn(1, 1, 16, 32)
    with pytest.raises(ValueError, match=match):
        flex_attention(q, q, q, score_mod=score_mod)


def test_error_for_captured_tensor_on_another_device():
    bias = torch.randn(4, device="meta")
    q = torch.randn(1, 1, 16, 32)
    with pytest.raises(ValueError, match="on device meta"):
        flex_attention(q, q, q, score_mod=lambda s, b, h, qi, ki: s + bias[h])


def test_error_for_gqa_without_enable_gqa_and_mismatched_block_mask():
    q, k = torch.randn(1, 4, 16, 32), torch.randn(1, 2, 16, 32)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q, k, k)
    mask = create_block_mask(causal, None, None, 32, 32)
    with pytest.raises(ValueError, match="made for lengths"):
        flex_attention(q, k, k, block_mask=mask, enable_gqa=True)
    for wrong in ("causal", torch.ones(16, 16, dtype=torch.bool)):
        with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
            flex_attention(q, k, k, block_mask=wrong, enable_gqa=True)
    for batch, heads, match in ((2, None, "batch size 2, the query has 3"), (None, 2, "heads 2, the query has 4")):
        mask = create_block_mask(causal, batch, heads, 16, 16)
        with pytest.raises(ValueError, match=match):
            flex_attention(torch.randn(3, 4, 16, 32), k.expand(3, -1, -1, -1), k.expand(3, -1, -1, -1),
                           block_mask=mask, enable_gqa=True)


# --- what the mods read is read on every call ----------------------------------------------------
# torch's flex_attention runs the user's functions as they are at call time; so must we (no
# stale trace reused for a function whose closure cells, partial arguments, globals, dict
# entries, helper globals or module attributes now hold other values).
class _Config:
    alpha = 0.5


CONFIG = _Config()
PARAMS = {"alpha": 0.5, "bias": torch.zeros(2)}
HELPER_ALPHA = 0.5


def _helper_alpha():
    return HELPER_ALPHA


def _scaled(score, b, h, q_idx, kv_idx, alpha=1.0):
    return score * alpha


class _Temperature(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = 0.5

    def forward(self, score, b, h, q_idx, kv_idx):
        return score / self.temperature + (kv_idx - q_idx) * 0.01


def _partial_case(value):
    return functools.partial(_scaled, alpha=value)


def _closure_case():
    alpha = 0.5

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * alpha

    def set_value(value):
        nonlocal alpha
        alpha = value

    return score_mod, set_value


def _value_cases():
    """name -> (score_mod for the value): each call rebinds what the function reads."""
    closure_mod, set_closure = _closure_case()
    module = _Temperature()

    def config_mod(score, b, h, q_idx, kv_idx):
        return score * CONFIG.alpha

    def dict_mod(score, b, h, q_idx, kv_idx):
        return score * PARAMS["alpha"]

    def helper_mod(score, b, h, q_idx, kv_idx):
        return score * _helper_alpha()

    def bias_mod(score, b, h, q_idx, kv_idx):
        return score + PARAMS["bias"][h]

    def set_global(name, value):
        globals()[name] = value

    return {
        "partial": lambda value: _partial_case(value),
        "closure": lambda value: (set_closure(value), closure_mod)[1],
        "object attribute": lambda value: (setattr(CONFIG, "alpha", value), config_mod)[1],
        "dict entry": lambda value: (PARAMS.__setitem__("alpha", value), dict_mod)[1],
        "helper's global": lambda value: (set_global("HELPER_ALPHA", value), helper_mod)[1],
        "module attribute": lambda value: (setattr(module, "temperature", value), module)[1],
        "rebound tensor": lambda value: (PARAMS.__setitem__("bias", torch.tensor([value, -value])), bias_mod)[1],
    }


@pytest.mark.parametrize("case", list(_value_cases()))
def test_score_mod_values_are_read_at_call_time(gen, case):
    """... and a new value of a number is a run-time input of the same kernel (one key)."""
    make = _value_cases()[case]
    q, k, v = (torch.randn(1, 2, 75, 32, generator=gen) for _ in range(3))
    keys = set()
    for value in (0.5, 2.0, 4.0):
        score_mod = make(value)
        ours = flex_attention(q, k, v, score_mod=score_mod)
        keys.add(flex_trace.capture("score_mod", score_mod).key)
        ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), score_mod=score_mod)
        torch.testing.assert_close(ours.double(), ref.transpose(1, 2), atol=1e-4, rtol=0,
                                   msg=lambda m: f"{case} = {value}: {m}")
        del score_mod, ours  # a freed partial's id is reused by the next one (CPython)
    assert len(keys) == 1, f"{case}: a kernel per value"


def test_a_value_read_with_item_is_read_at_call_time(gen):
    """A score_mod that reads a tensor's value as a Python number: its trace holds the number,
    which an in-place change of the tensor left as it was at the first call (silently)."""
    temperature = torch.tensor([0.5])

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temperature[0].item()

    q, k, v = (torch.randn(1, 2, 37, 16, generator=gen) for _ in range(3))
    for value in (0.5, 3.0):
        temperature[0] = value
        ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)),
                                     score_mod=lambda score, *idx: score * value)
        torch.testing.assert_close(flex_attention(q, k, v, score_mod=score_mod).double(), ref.transpose(1, 2),
                                   atol=1e-4, rtol=0, msg=lambda m: f"temperature {value}: {m}")


def test_score_and_mask_mods_with_closure_tensors_of_their_own(gen, seed):
    """ALiBi slopes in score_mod's closure and document ids in mask_mod's: both tensors were named
    `captured` (dynamo's placeholders of closure cells), an error the user could not rename away."""
    seqlen = 100
    slopes = torch.rand(2, generator=gen)
    documents = torch.tensor([0] * 30 + [1] * 45 + [2] * 25)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def in_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (documents[q_idx] == documents[kv_idx])

    q, k, v = (torch.randn(1, 2, seqlen, 16, generator=gen) for _ in range(3))
    ours = flex_attention(q, k, v, score_mod=alibi, block_mask=create_block_mask(in_document, None, None, seqlen,
                                                                                 seqlen))
    ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), score_mod=alibi,
                                 mask=flex_trace.dense_mask(in_document, 1, 2, seqlen, seqlen))
    torch.testing.assert_close(ours.double(), ref.transpose(1, 2), atol=1e-4, rtol=0)


def test_mask_mod_values_are_read_at_call_time(gen):
    q, k, v = (torch.randn(1, 2, 150, 32, generator=gen) for _ in range(3))
    for window in (10, 70):
        PARAMS["window"] = window

        def windowed(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= PARAMS["window"])

        mask = create_block_mask(windowed, None, None, 150, 150)
        ours = flex_attention(q, k, v, block_mask=mask)
        dense = flex_trace.dense_mask(windowed, 1, 2, 150, 150)
        ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), mask=dense)
        torch.testing.assert_close(ours.double(), ref.transpose(1, 2), atol=1e-4, rtol=0)


def test_score_mods_with_defaults_and_bound_methods(gen):
    """Tensors captured as default arguments (positional or keyword-only) and bound methods."""
    q, k, v = (torch.randn(1, 2, 70, 32, generator=gen) for _ in range(3))
    bias = torch.randn(2, generator=gen)

    def positional_default(score, b, h, q_idx, kv_idx, bias=bias):
        return score + bias[h]

    def keyword_default(score, b, h, q_idx, kv_idx, *, bias=bias):
        return score + bias[h] * 2

    class Holder:
        def __init__(self):
            self.bias = bias * 3

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score + self.bias[h]

    for score_mod in (positional_default, keyword_default, Holder().score_mod):
        ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), score_mod=score_mod)
        compiled = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod), backend="aot_eager",
                                 fullgraph=True)
        for ours in (flex_attention(q, k, v, score_mod=score_mod), compiled(q, k, v)):
            torch.testing.assert_close(ours.double(), ref.transpose(1, 2), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_torch_compile_fullgraph_new_lengths_and_values(gen, dynamic):
    """Under torch.compile(fullgraph=True): a new sequence length (automatic dynamic shapes, or
    dynamic=True from the first call) compiles, and a number or tensor the score_mod reads is
    read on each call (dynamo guards on it), like torch's flex_attention."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * CONFIG.alpha + PARAMS["bias"][h]

    def attend(q, k, v, mask):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for seqlen, alpha in ((70, 0.5), (101, 0.5), (101, 3.0), (150, 2.0)):
        CONFIG.alpha = alpha
        PARAMS["bias"] = torch.randn(2, generator=gen)
        q, k, v = (torch.randn(1, 2, seqlen, 32, generator=gen) for _ in range(3))
        ours = compiled(q, k, v, create_block_mask(causal, None, None, seqlen, seqlen))
        ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), score_mod=score_mod,
                                     mask=flex_trace.dense_mask(causal, 1, 2, seqlen, seqlen))
        torch.testing.assert_close(ours.double(), ref.transpose(1, 2), atol=1e-4, rtol=0,
                                   msg=lambda m: f"seqlen {seqlen}, alpha {alpha}: {m}")
    CONFIG.alpha = 0.5


def _thresholded(score, b, h, q_idx, kv_idx, threshold=0.0, slope=1.0):
    return torch.where(score > threshold, score, score * slope) + torch.where(kv_idx - q_idx < threshold * 40, -1.5, 0.25)


def test_numbers_in_comparisons_and_where_are_kernel_inputs(gen):
    """Floats compared with scores and indices, and where's branches, are run-time inputs of one
    kernel: torch's promotion (int index vs float) is kept."""
    q, k, v = (torch.randn(1, 2, 90, 32, generator=gen) for _ in range(3))
    keys = set()
    for threshold, slope in ((0.0, 0.1), (0.3, 2.5), (-0.7, 0.5)):
        score_mod = functools.partial(_thresholded, threshold=threshold, slope=slope)
        ours = flex_attention(q, k, v, score_mod=score_mod)
        keys.add(flex_trace.capture("score_mod", score_mod).key)
        ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), score_mod=score_mod)
        torch.testing.assert_close(ours.double(), ref.transpose(1, 2), atol=1e-4, rtol=0)
    assert len(keys) == 1


def test_mods_named_like_the_identity_are_applied(gen):
    """Whether a mod is the identity is read from its graph, not its name: a user's `identity`
    score_mod that scales and a `noop_mask` mask_mod that masks are applied."""
    q, k, v = (torch.randn(1, 2, 81, 32, generator=gen) for _ in range(3))

    def identity(score, b, h, q_idx, kv_idx):
        return score * 2

    def noop_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(noop_mask, None, None, 81, 81)
    ours = flex_attention(q, k, v, score_mod=identity, block_mask=block_mask)
    dense = flex_trace.dense_mask(noop_mask, 1, 2, 81, 81)
    ref, _ = reference_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), score_mod=identity, mask=dense)
    torch.testing.assert_close(ours.double(), ref.transpose(1, 2), atol=1e-4, rtol=0)
    assert flex_trace.trace_score_mod(lambda s, b, h, i, j: s).is_identity
    assert not flex_trace.trace_score_mod(identity).is_identity


COMPILED_LSE_GRADIENT = r"""
import torch, tvmflash
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 37, 16, requires_grad=True) for _ in range(3))
table = torch.randn(2)
def score_mod(score, b, h, q_idx, kv_idx):
    return score * 1.5 + table[h]
out, lse = torch.compile(tvmflash.flex_attention, fullgraph=True)(q, k, v, score_mod=score_mod, return_lse=True)
(out.sum() + lse.sum()).backward()
print("ok", float(q.grad.double().norm()))
"""


def test_a_compiled_lse_gradient_loaded_from_torchs_cache_finds_its_kernels(tmp_path):
    """The second process's compiled backward comes from inductor's cache, and named the lse
    gradient's wider spec, which only the first process's tracing of it had registered
    (KeyError)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    runs = [subprocess.run([sys.executable, "-c", COMPILED_LSE_GRADIENT], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert runs[0].stdout.split()[-1] == runs[1].stdout.split()[-1]  # (the same gradient)

