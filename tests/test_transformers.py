"""tvmflash as a Hugging Face transformers attention implementation, checked against ``eager``.

Small models (2 layers, gpt-oss 4: its two kinds in turn; hidden 64, 4 heads, 2 KV heads,
head_dim 16, vocab 128) built from configs with random weights; each test builds the same
weights twice, once with ``eager`` (the reference: it implements every mask, window and
softcap) and once with tvmflash. fp32: loss within 1e-4 relative, every parameter gradient
within 1e-3 relative norm, greedy ``generate()`` the same tokens (and its scores within 1e-4).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import count_calls  # noqa: E402
from tvmflash import documents, padded, torch_op  # noqa: E402
from tvmflash import sinks as sinks_module  # noqa: E402
from tvmflash.integrations import transformers as tvm_hf  # noqa: E402

LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-3
WINDOW = 8  # shorter than the sequences: the windows matter
CACHE_KWARG = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0, tie_word_embeddings=False,
              # larger than the default 0.02: attention far from uniform, softcap in its nonlinear range
              initializer_range=0.1)


def _config(model: str):
    if model == "llama":
        return transformers.LlamaConfig(**COMMON)
    if model == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
    if model == "gemma2":  # alternating sliding/full layers, softcap 2 on scores of size ~1-5
        return transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=None)
    if model == "qwen2":  # layer 0 full, layer 1 sliding
        return transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if model == "gpt_oss":  # attention sinks; sliding and full layers in turn (each kind twice); 4 experts, 2 per token
        return transformers.GptOssConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         layer_types=["sliding_attention", "full_attention"] * 2)
    raise ValueError(model)


MODELS = ["llama", "mistral", "gemma2", "qwen2"]


@functools.cache
def _models(model: str, dtype: torch.dtype = torch.float32):
    """(eager, tvmflash) with the same weights; the config is deep-copied per model because
    ``from_config(attn_implementation=...)`` writes into it."""
    name = tvm_hf.register()
    cfg = _config(model)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                                           dtype=dtype)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name, dtype=dtype)
    if model == "gpt_oss":  # sinks of the size trained ones reach (initialized at ~0.1: a share of ~1/n)
        with torch.no_grad():
            for layer in eager.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 1.5 + 1)
    ours.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and ours.config._attn_implementation == name
    return eager, ours


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _loss_and_grads(model, **inputs):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def _assert_matches_eager(model: str, real: torch.Tensor | None = None, **inputs):
    eager, ours = _models(model)
    loss_e, logits_e, grads_e = _loss_and_grads(eager, **inputs)
    loss_o, logits_o, grads_o = _loss_and_grads(ours, **inputs)
    assert torch.isfinite(loss_o) and all(torch.isfinite(g).all() for g in grads_o.values())
    loss_err = abs(loss_o.item() - loss_e.item()) / abs(loss_e.item())
    assert loss_err <= LOSS_RTOL, f"{model}: loss {loss_o.item()} vs eager {loss_e.item()}"
    assert grads_o.keys() == grads_e.keys()
    grad_errs = {n: _rel(grads_o[n], grads_e[n]) for n in grads_e}
    worst = max(grad_errs, key=grad_errs.get)
    assert grad_errs[worst] <= GRAD_RTOL, f"{model}: gradient of {worst} off by {grad_errs[worst]:.2e} (relative norm)"
    if real is not None:  # logits of the real tokens (padding positions are not defined by transformers)
        assert _rel(logits_o[real], logits_e[real]) <= LOSS_RTOL
    return loss_err, grad_errs[worst]


def _with_compiled_forward(model: str):
    """(eager, ours, a copy of ours whose forward is compiled with fullgraph=True), in eval mode."""
    torch._dynamo.reset()  # (the other tests' compiles of these code objects count towards dynamo's recompile limit)
    eager, ours = _models(model)
    compiled = copy.deepcopy(ours).eval()
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager", fullgraph=True)
    return eager.eval(), ours, compiled


def _assert_same_generation(got, want) -> None:
    """greedy ``generate()`` outputs (``return_dict_in_generate``, ``output_scores``) against
    eager's: the scores of each step up to the first new token that differs within LOSS_RTOL,
    then the same tokens. A failure names that step, the scores' error there and eager's gap
    between its two best tokens: a near tie, or a wrong result."""
    steps = len(want.scores)
    differs = (got.sequences[:, -steps:] != want.sequences[:, -steps:]).any(0).nonzero().flatten()
    last = int(differs[0]) if len(differs) else steps - 1
    errors = [_rel(a, b) for a, b in zip(got.scores[:last + 1], want.scores[:last + 1])]
    best = want.scores[last].topk(2, dim=-1).values
    detail = (f"step {last}: scores off by {max(errors):.2e} (relative), eager's gap between its two best tokens "
              f"{(best[:, 0] - best[:, 1]).min().item():.2e}")
    assert max(errors) <= LOSS_RTOL, detail
    assert torch.equal(got.sequences, want.sequences), detail


def _padded_batch(gen: torch.Generator, length: int = 24):
    """Rows: left padding, right padding, none, all padding; labels -100 on the padding."""
    ids = torch.randint(0, 128, (4, length), generator=gen)
    mask = torch.ones(4, length, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, -7:] = 0
    mask[3, :] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("batch", ["plain", "padded", "holes", "documents"])
def test_gpt_oss_attention_sinks_match_eager(batch, gen, monkeypatch):
    """gpt-oss's attention sinks (``s_aux``; ``sinks.py``): loss and every gradient, the sinks'
    included, as eager's, on rows without padding, a padded batch (left, right, a row of padding
    only, whose rows the sink takes whole) and a hole on the sliding layer (flex_attention over
    the mask); every call on the sinks' op. Documents packed into rows by position_ids: each
    document's logits as eager's on that document alone (gpt-oss's eager masks do not read
    position_ids, flash_attention_2's rule, ours, does: its masks let documents see each other)."""
    calls = []
    original = padded._sink_ops.__call__
    monkeypatch.setattr(type(padded._sink_ops), "__call__", lambda self, *a: calls.append(1) or original(*a))
    repeats = count_calls(monkeypatch, sinks_module, "repeated_training")
    if batch == "documents":
        lengths = ([7, 10, 7], [3, 21], [24])
        position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
        ids = torch.randint(0, 128, position_ids.shape, generator=gen)
        eager, ours = _models("gpt_oss")
        with torch.no_grad():
            got = ours.eval()(input_ids=ids, position_ids=position_ids, use_cache=False).logits
            for row, documents in enumerate(lengths):
                starts = [sum(documents[:i]) for i in range(len(documents))]
                for start, n in zip(starts, documents):
                    want = eager.eval()(input_ids=ids[row:row + 1, start:start + n], use_cache=False).logits[0]
                    assert _rel(got[row, start:start + n], want) <= LOSS_RTOL, (row, start)
    elif batch == "plain":
        ids = torch.randint(0, 128, (2, 21), generator=gen)
        _assert_matches_eager("gpt_oss", input_ids=ids, labels=ids)
    else:
        ids, mask, labels = _padded_batch(gen)
        if batch == "holes":
            mask[2, 9] = 0
            labels[2, 9:11] = -100
        _assert_matches_eager("gpt_oss", real=mask.bool(), input_ids=ids, attention_mask=mask, labels=labels)
    # (a training forward's second layer of a kind repeats the first's call, where its rows were read in place)
    repeated = 2 if batch in ("plain", "padded") else 0
    assert (len(calls), len(repeats)) == (4 - repeated, repeated)


def test_gpt_oss_generate_matches_eager(gen, monkeypatch):
    """Greedy generate() with attention sinks from left-padded prompts: scores and tokens as
    eager's; every new token on the decode kernel (its lse renormalized), past the window: the
    steps after the first of their kind repeat the checked step (the fp32 out and lse, then the
    rescale)."""
    eager, ours = _models("gpt_oss")
    ids = torch.randint(1, 128, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kernel_calls, repeated = _decode_steps(monkeypatch)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        want = eager.eval().generate(ids, **kwargs)
        got = ours.eval().generate(ids, **kwargs)
    _assert_same_generation(got, want)
    assert len(kernel_calls) + len(repeated) == 15 * ours.config.num_hidden_layers and repeated


def _decode_steps(monkeypatch) -> tuple[list, list]:
    """The integration's decode steps, counted: (those of ``flash_attn_with_kvcache``, the checked
    path; those that repeat a checked step: ``repeated_heads_first_step`` and
    ``repeated_decode_step`` returning a result)."""
    kernel_calls, repeated = count_calls(monkeypatch, tvm_hf, "flash_attn_with_kvcache"), []
    for name in ("repeated_heads_first_step", "repeated_decode_step"):
        monkeypatch.setattr(tvm_hf, name, lambda *a, original=getattr(tvm_hf, name), **kw: (
            lambda out: repeated.extend([] if out is None else [1]) or out)(original(*a, **kw)))
    return kernel_calls, repeated


def test_gpt_oss_compiled_generate_with_static_cache_matches_eager(gen, monkeypatch):
    """Attention sinks in transformers' fast-generation recipe (static cache, compiled forward,
    fullgraph=True): each new token the decode op with sinks, on the decode kernel (left padding
    read in place, the cache's empty slots cut when it runs). Tokens and scores as eager's."""
    eager, ours, compiled = _with_compiled_forward("gpt_oss")
    kernel_calls, repeated = _decode_steps(monkeypatch)
    ids = torch.randint(1, 128, (2, 9), generator=gen)
    mask = torch.tensor([[0, 0, 0] + [1] * 6, [1] * 9])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                  cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        got, want = compiled.generate(ids * mask, **kwargs), eager.generate(ids * mask, **kwargs)
    _assert_same_generation(got, want)
    # (the op's body, when the graph runs: the first step of each kind checked, the others repeat it)
    assert len(kernel_calls) + len(repeated) == 9 * ours.config.num_hidden_layers and repeated


def test_gpt_oss_compiled_training_is_one_graph(gen):
    """Attention sinks under torch.compile: one op per layer, fullgraph=True; one graph serves a
    padded batch and a mask of ones; loss and every gradient as eager's."""
    eager, ours = _models("gpt_oss")
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    ids, mask, labels = _padded_batch(gen)
    _assert_one_graph_matches_eager(eager, ours, compiled, [dict(input_ids=ids, attention_mask=mask, labels=labels),
                                                           dict(input_ids=ids, attention_mask=torch.ones_like(mask),
                                                                labels=ids.clone())])


def test_register_gives_a_usable_name():
    name = tvm_hf.register()
    assert name == tvm_hf.register() == tvm_hf.NAME
    assert "flash" not in name  # transformers would send it to its flash-attention kernel loader
    assert transformers.AttentionInterface._global_mapping[name] is tvm_hf.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping[name] is tvm_hf.key_padding_mask
    with pytest.raises(ValueError, match="flash"):
        tvm_hf.register("my_flash_attention")


@pytest.mark.parametrize("model", [*MODELS, "gpt_oss"])
def test_repeated_training_steps_match_eager(model, gen, monkeypatch):
    """Training steps after the first: the layers' calls read q, k, v in transformers' layout
    (``repeated_heads_first_training``, forward and backward; sliding windows, Gemma 2's
    softcap; gpt-oss's sinks: ``padded``'s on the mask of all keys), loss and gradients as
    eager's step after step."""
    took = []
    for module in (tvm_hf, padded):
        original = module.repeated_heads_first_training
        monkeypatch.setattr(module, "repeated_heads_first_training", lambda *a, original=original: (
            lambda out: took.append(out is not None) or out)(original(*a)))
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 21), generator=gen)
        _assert_matches_eager(model, input_ids=ids, labels=ids)
    assert took[-1] and sum(took) >= _config(model).num_hidden_layers


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("model", [*MODELS, "gpt_oss"])
def test_padded_batch_loss_and_gradients_match_eager(model, gen, monkeypatch, holes):
    """Rows of one run of real tokens each are read in place (the padded op's row runs; after
    the first layer of a kind, its repeat: ``padded.repeated_heads_first_training``); a pad
    token inside a row (a hole) takes the gather into packed sequences, or on sliding-window
    layers flex_attention with the mask (the window counts positions in the row, as eager's
    does)."""
    in_place, repeated, over_holes = [], [], []
    for module, name, seen in ((torch_op, "row_runs_forward", in_place), (padded, "flex_attention_forward", over_holes),
                               (padded, "repeated_heads_first_training", repeated)):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, original=original, seen=seen, **kw:
                            seen.append(original(*a, **kw)) or seen[-1])
    ids, mask, labels = _padded_batch(gen)
    if holes:  # (the hole's own prediction, of token 10, is ignored: transformers leaves padding rows undefined)
        mask[2, 9] = 0
        labels[2, 9:11] = -100
    _assert_matches_eager(model, real=mask.bool(), input_ids=ids, attention_mask=mask, labels=labels)
    config = _config(model)
    layers = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None) or (
        ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * layers)
    sliding = kinds.count("sliding_attention")
    repeats = [out for out in repeated if out is not None]
    assert len(in_place) == (0 if holes else len(set(kinds))) and all(out is not None for out in in_place)
    assert len(repeats) == (0 if holes else layers - len(set(kinds)))
    assert len(over_holes) == (sliding if holes else 0)


def test_compiled_model_matches_eager(gen):
    """A model under torch.compile (the integration's Python runs between graphs; the kernels are
    custom ops): a padded batch with a hole on Mistral's sliding windows (flex_attention), loss
    and gradients against eager."""
    ids, mask, labels = _padded_batch(gen)
    mask[2, 9] = 0
    labels[2, 9:11] = -100  # (the hole's own prediction: padding rows are undefined)
    eager, ours = _models("mistral")
    compiled = torch.compile(ours.train(), backend="aot_eager")
    loss_e, _, grads_e = _loss_and_grads(eager, input_ids=ids, attention_mask=mask, labels=labels)
    ours.zero_grad(set_to_none=True)
    loss_o = compiled(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss_o.backward()
    assert abs(loss_o.item() - loss_e.item()) <= LOSS_RTOL * abs(loss_e.item())
    worst = max(_rel(p.grad, grads_e[n]) for n, p in ours.named_parameters())
    assert worst <= GRAD_RTOL


def test_compiled_training_is_one_graph_for_documents_and_plain_rows(gen):
    """Without a padding mask the attention is one op per layer under torch.compile (the
    documents that position_ids mark are found when it runs): fullgraph=True compiles, and one
    graph serves rows of one sequence and rows packed with documents (sliding windows within
    them), loss and gradients as eager's."""
    eager, ours = _models("mistral")
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    plain = torch.arange(24).repeat(3, 1)
    packed = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([7, 10, 7], [3, 21], [24])])
    ids = torch.randint(0, 128, (3, 24), generator=gen)
    _assert_one_graph_matches_eager(eager, ours, compiled, [dict(input_ids=ids, position_ids=position_ids, labels=ids)
                                                           for position_ids in (plain, packed)])


def _assert_one_graph_matches_eager(eager, ours, compiled, batches: list[dict], references: list[dict] | None = None
                                    ) -> None:
    """Training steps of ``compiled`` (``ours`` compiled) on each batch: no recompile after the
    first, loss and every parameter gradient as ``eager``'s (on ``references``' batches, if
    given)."""
    for step, inputs in enumerate(batches):
        loss_e, _, grads_e = _loss_and_grads(eager, **(inputs if references is None else references[step]))
        ours.zero_grad(set_to_none=True)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss_o = compiled(**inputs, use_cache=False).loss
            loss_o.backward()
        assert abs(loss_o.item() - loss_e.item()) <= LOSS_RTOL * abs(loss_e.item()), step
        assert max(_rel(p.grad, grads_e[n]) for n, p in ours.named_parameters()) <= GRAD_RTOL, step


@pytest.mark.parametrize("model", ["llama", "gemma2"])
def test_compiled_padded_training_is_one_graph(model, gen):
    """With a padding mask the attention is one op per layer under torch.compile too (the mask's
    runs, holes and rows that see no key are read when it runs): fullgraph=True compiles, and one
    graph serves left and right padding, a hole inside a row and a mask of ones, loss and every
    gradient as eager's (the rows that see no key predict the first tokens: eager's mean of v).
    Gemma2: sliding windows shorter than the rows (over the hole: flex inside the op), softcap."""
    eager, ours = _models(model)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    ids, mask, labels = _padded_batch(gen)
    holes, hole_labels = mask.clone(), labels.clone()
    holes[2, 9] = 0
    hole_labels[2, 9:11] = -100  # (the hole's own prediction: padding rows are undefined)
    ones = torch.ones_like(mask)
    _assert_one_graph_matches_eager(eager, ours, compiled, [dict(input_ids=ids, attention_mask=m, labels=lab)
                                                           for m, lab in ((mask, labels), (holes, hole_labels),
                                                                          (ones, ids.clone()))])


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_compiled_mask_of_ones_separates_documents_as_eager_mode_does(model, gen):
    """A mask of ones with position_ids that restart, without a cache: in eager mode tvmflash's
    mask builder drops the mask and the documents are found by position_ids (flash_attention_2's
    rule); compiled, the mask reaches the padded op, which reads the position_ids when it runs.
    Both give eager's loss and gradients on the documents (no mask), and one graph also serves
    a padded batch (where the mask rules and the positions do not separate anything)."""
    eager, ours = _models(model)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    ids, mask, labels = _padded_batch(gen)
    plain = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)
    packed = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ([7, 10, 7], [3, 21], [24], [12, 12])])
    padded_batch = dict(input_ids=ids, attention_mask=mask, position_ids=plain, labels=labels)
    documents_batch = dict(input_ids=ids, attention_mask=torch.ones_like(mask), position_ids=packed, labels=ids.clone())
    without_mask = dict(input_ids=ids, position_ids=packed, labels=ids)
    loss_e, _, grads_e = _loss_and_grads(eager, **without_mask)
    loss_o, _, grads_o = _loss_and_grads(ours, **documents_batch)  # (eager mode)
    assert abs(loss_o.item() - loss_e.item()) <= LOSS_RTOL * abs(loss_e.item())
    assert max(_rel(grads_o[n], grads_e[n]) for n in grads_e) <= GRAD_RTOL
    _assert_one_graph_matches_eager(eager, ours, compiled, [padded_batch, documents_batch],
                                    references=[padded_batch, without_mask])


@pytest.mark.parametrize("model", ["llama", "gemma2"])
def test_padded_batch_inference_matches_eager_on_blind_rows(model, gen):
    """Without gradients, rows that see no key (left padding, a row of padding only) take eager's
    mean of v directly: their logits match eager's too, as do the real tokens'."""
    eager, ours = _models(model)
    ids, mask, _ = _padded_batch(gen)
    with torch.no_grad():
        want, got = (m.eval()(input_ids=ids, attention_mask=mask).logits for m in (eager, ours))
    defined = mask.bool().clone()
    defined[0, :5] = True  # left padding: blind rows
    defined[3] = True  # padding only: every row blind
    assert _rel(got[defined], want[defined]) <= LOSS_RTOL


@pytest.mark.parametrize("model", ["mistral", "gemma2"])
def test_packed_documents_by_position_ids_match_eager(model, gen):
    """Documents packed into rows, told apart by restarting position_ids (eager: no mask, no cache)."""
    lengths = [[7, 10, 7], [3, 21], [24]]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    ids = torch.randint(0, 128, position_ids.shape, generator=gen)
    _assert_matches_eager(model, input_ids=ids, position_ids=position_ids, labels=ids)


def test_positions_that_restart_with_a_kv_cache_are_one_sequence_as_in_eager(gen):
    """transformers tells documents apart by position_ids only without a cache (its masks): with
    one (use_cache, the default of a model in eval), a row is one sequence to eager and to us."""
    eager, ours = _models("llama")
    ids = torch.randint(0, 128, (1, 20), generator=gen)
    position_ids = torch.cat([torch.arange(8), torch.arange(12)])[None]
    with torch.no_grad():
        for use_cache in (True, False):
            want, got = (m.eval()(input_ids=ids, position_ids=position_ids, use_cache=use_cache).logits
                         for m in (eager, ours))
            assert _rel(got, want) <= LOSS_RTOL, use_cache


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_packed_documents_by_cu_seq_lens_match_eager(model, gen, monkeypatch):
    """DataCollatorWithFlattening's kwargs: one row, cu_seq_lens_q/k; only they separate the
    documents here (the position_ids rule is switched off in tvmflash)."""
    lengths = [5, 12, 9, 14]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    ids = torch.randint(0, 128, position_ids.shape, generator=gen)
    eager, ours = _models(model)
    loss_e, _, grads_e = _loss_and_grads(eager, input_ids=ids, position_ids=position_ids, labels=ids)
    monkeypatch.setattr(documents, "documents_from_positions", lambda *args: None)
    loss_o, _, grads_o = _loss_and_grads(ours, input_ids=ids, position_ids=position_ids, labels=ids,
                                         cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                                         max_length_k=max(lengths))
    assert abs(loss_o.item() - loss_e.item()) <= LOSS_RTOL * abs(loss_e.item())
    assert max(_rel(grads_o[n], grads_e[n]) for n in grads_e) <= GRAD_RTOL


@pytest.mark.parametrize("model", MODELS)
def test_generate_greedy_matches_eager(model, gen, monkeypatch):
    """Left-padded prompts; prefill, then 16 single-token steps against the KV cache (past the
    sliding window, and past the padding leaving the sliding layers' caches)."""
    eager, ours = _models(model)
    eager.eval()
    ours.eval()
    ids = torch.randint(1, 128, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    decode_calls = []  # per call: whether the cache had padding
    decode = tvm_hf.decode_attention

    def counting_decode(q, k, v, key_mask, **kw):
        decode_calls.append(key_mask is not None)
        return decode(q, k, v, key_mask, **kw)

    monkeypatch.setattr(tvm_hf, "decode_attention", counting_decode)
    kernel_calls = count_calls(monkeypatch, tvm_hf, "flash_attn_with_kvcache")
    repeated = tvm_hf.repeated_decode_step  # (steps like one checked before: the kernel without the checks)
    monkeypatch.setattr(tvm_hf, "repeated_decode_step",
                        lambda *a: (lambda out: out if out is None else kernel_calls.append(1) or out)(repeated(*a)))
    # (steps without a mask like the layers' before, before decode_attention: e.g. the sliding
    # layers' caches once the padding has left them)
    heads_first = tvm_hf.repeated_heads_first_step
    monkeypatch.setattr(tvm_hf, "repeated_heads_first_step", lambda *a: (
        lambda out: out if out is None else decode_calls.append(False) or kernel_calls.append(1) or out)(
            heads_first(*a)))
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        want = eager.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)
    _assert_same_generation(got, want)
    layers = ours.config.num_hidden_layers
    assert len(decode_calls) == 15 * layers and any(decode_calls)  # every new token went through decode_attention
    assert len(kernel_calls) == len(decode_calls)  # left-padded caches: all on the KV-cache kernel

    with torch.no_grad():  # one prompt, no padding: no mask at all
        single = ids[1:2]
        assert torch.equal(ours.generate(single, max_new_tokens=12, do_sample=False, pad_token_id=0),
                           eager.generate(single, max_new_tokens=12, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("model", ["mistral", "gemma2"])
def test_generate_with_holes_in_the_prompt_matches_eager(model, gen):
    """A pad token inside a prompt (generate() masks it: a hole) and prompts longer than the
    window: the prefill's sliding layers and the decode steps count the window in positions of
    the row, holes included, as eager does."""
    eager, ours = _models(model)
    ids = torch.randint(1, 128, (2, 14), generator=gen)
    ids[0, 9], ids[1, 3:5] = 0, 0  # holes: inside the last window of row 0, before it in row 1
    kwargs = dict(attention_mask=(ids != 0).long(), max_new_tokens=12, do_sample=False, pad_token_id=0,
                  output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        want, got = (m.eval().generate(ids, **kwargs) for m in (eager, ours))
    _assert_same_generation(got, want)


def test_generate_under_inference_mode_matches_no_grad(gen):
    """torch.inference_mode() (what serving code uses): its tensors have no version counter, which
    the per-tensor caches of masks and documents key on."""
    _, ours = _models("llama")
    ours.eval()
    ids = torch.randint(1, 128, (2, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ours.generate(ids * mask, **kwargs)
    with torch.inference_mode():
        got = ours.generate(ids * mask, **kwargs)
        packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]])  # documents by restarting positions
        logits = ours(input_ids=ids[:1], position_ids=packed).logits
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(logits, ours(input_ids=ids[:1], position_ids=packed).logits)


def test_generate_with_static_cache_matches_eager(gen):
    """A static cache: slots after the last token are empty (zeros); generate() drops an all-ones
    mask for non-flash implementations, so the mask builder cuts the keys to the written ones."""
    eager, ours = _models("gemma2")
    eager.eval()
    ours.eval()
    ids = torch.randint(1, 128, (2, 9), generator=gen)
    for mask in (torch.ones_like(ids), torch.tensor([[0, 0, 0] + [1] * 6, [1] * 9])):
        kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                      cache_implementation="static", output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            _assert_same_generation(ours.generate(ids * mask, **kwargs), eager.generate(ids * mask, **kwargs))


def test_compiled_generate_with_static_cache_matches_eager(gen, monkeypatch):
    """transformers' recipe for fast generation: a static cache and the forward compiled
    (fullgraph=True: no graph break). The prefill is the padded op over the mask (the cache's
    empty slots after it), each new token the decode op, which reads the mask when it runs: a
    mask of the cache's fixed length where generate() drops an all-ones one. Tokens and scores
    as eager's."""
    eager, ours, compiled = _with_compiled_forward("llama")
    decode_calls = count_calls(monkeypatch, tvm_hf, "decode_attention")
    ids = torch.randint(1, 128, (2, 9), generator=gen)
    for mask in (torch.ones_like(ids), torch.tensor([[0, 0, 0] + [1] * 6, [1] * 9])):
        kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                      cache_implementation="static", output_scores=True, return_dict_in_generate=True)
        decode_calls.clear()
        with torch.no_grad():
            got, want = compiled.generate(ids * mask, **kwargs), eager.generate(ids * mask, **kwargs)
        _assert_same_generation(got, want)
        assert len(decode_calls) == 9 * ours.config.num_hidden_layers  # (the op's body: when the graph runs)


def test_decode_op_opcheck(gen):
    """The decode op torch.compile's graphs call for each new token: its fake agrees with its
    body, without a mask, with left padding, with a hole, and with a mask of the static cache's
    fixed length whose last columns are empty slots."""
    q = torch.randn(3, 1, 4, 16, generator=gen)
    k, v = (torch.randn(3, 21, 2, 16, generator=gen) for _ in range(2))
    left = torch.ones(3, 17, dtype=torch.bool)
    left[0, :5] = False
    holes = left.clone()
    holes[1, 8] = False
    fixed = torch.nn.functional.pad(left, (0, 4))
    sinks = torch.randn(4, generator=gen)
    for mask in (None, left, holes, fixed):
        torch.library.opcheck(tvm_hf._decode_op, (q, k, v, mask, None, True, -1, 0, 0.0))
        torch.library.opcheck(tvm_hf._decode_sinks_op, (q, k, v, mask, sinks, None, True, -1, 0, 0.0))
    want = tvm_hf.decode_attention(q, k, v, left, softmax_scale=None, causal=True, window_size=(-1, 0), softcap=0.0)
    assert torch.equal(tvm_hf._decode_op(q, k, v, fixed, None, True, -1, 0, 0.0), want)


def test_set_attn_implementation_switches_a_built_model(gen):
    cfg = _config("gemma2")
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(0, 128, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(tvm_hf.register())
        got = model(ids, attention_mask=mask).logits
    assert model.config._attn_implementation == tvm_hf.NAME
    assert _rel(got[mask.bool()], want[mask.bool()]) <= LOSS_RTOL


def test_attention_dropout_is_refused():
    cfg = _config("llama")
    cfg.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=tvm_hf.register())
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(torch.zeros(1, 8, dtype=torch.long))
    model.eval()  # no dropout in eval mode
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long)).logits).all()


def test_4d_mask_is_refused():
    _, ours = _models("llama")
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="2D"):
        ours(torch.zeros(1, 8, dtype=torch.long), attention_mask=mask)


def test_masks_that_do_not_fit_the_layer_are_refused(gen):
    """A padding mask longer than the layer's keys, or shorter than its queries, is a clear
    error on the decode path (decode_attention) and the padded op alike, not a read past the
    cache."""
    opts = {"softmax_scale": None, "causal": True, "window_size": (-1, -1), "softcap": 0.0}
    k = torch.randn(2, 10, 2, 32, generator=gen)
    for len_q, n, match in ((1, 12, "covers 12 keys"), (1, 0, "covers 0 keys"), (5, 12, "padding mask must be"),
                            (5, 3, "padding mask must be")):
        q = torch.randn(2, len_q, 4, 32, generator=gen)
        with pytest.raises(ValueError, match=match):
            tvm_hf._padded_attention(q, k, k, torch.ones(2, n, dtype=torch.bool), opts)
    for len_q in (1, 5):  # a mask for another batch
        with pytest.raises(ValueError, match="shape \\(3, 8\\)|padding mask must be"):
            tvm_hf._padded_attention(torch.randn(2, len_q, 4, 32, generator=gen), k, k,
                                     torch.ones(3, 8, dtype=torch.bool), opts)


def test_chunked_attention_past_one_chunk_is_refused(gen):
    """Llama 4's chunked layers (attention within chunks of attention_chunk_size tokens) are not
    implemented: within one chunk the model matches eager, past it a clear error (the chunks
    would be lost: silently wrong logits before)."""
    name = tvm_hf.register()
    config = transformers.Llama4TextConfig(**{**COMMON, "num_hidden_layers": 2}, head_dim=16, intermediate_size_mlp=128,
                                           num_local_experts=1, attention_chunk_size=8)
    assert "chunked_attention" in config.layer_types
    models = {}
    for impl in ("eager", name):
        torch.manual_seed(0)
        models[impl] = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
    ids = torch.randint(0, 128, (2, 8), generator=gen)
    with torch.no_grad():
        want, got = (models[impl](input_ids=ids).logits for impl in ("eager", name))
        assert _rel(got, want) <= LOSS_RTOL
        with pytest.raises(NotImplementedError, match="attention_chunk_size=8"):
            models[name](input_ids=torch.randint(0, 128, (2, 9), generator=gen))


def test_bfloat16_padded_batch_close_to_eager(gen):
    """16-bit inputs reach the bf16 kernels; eager in bf16 differs by rounding only."""
    eager, ours = _models("llama", torch.bfloat16)
    ids, mask, labels = _padded_batch(gen)
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, labels=labels)
        got = ours(input_ids=ids, attention_mask=mask, labels=labels)
    assert abs(got.loss.item() - want.loss.item()) <= 2e-2 * abs(want.loss.item())
    real = mask.bool()
    assert _rel(got.logits[real], want.logits[real]) <= 2e-2


@pytest.mark.parametrize("model", ["mistral", "gemma2"])
def test_prefill_in_chunks_matches_eager(model, gen):
    """A prompt fed in two chunks: the second chunk's queries (several) attend to the cache and
    to each other, left padding in the first chunk, windows across the boundary."""
    eager, ours = _models(model)
    eager.eval()
    ours.eval()
    ids = torch.randint(1, 128, (2, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    logits = {}
    for tag, m in (("eager", eager), ("ours", ours)):
        with torch.no_grad():
            first = m(input_ids=ids[:, :11], attention_mask=mask[:, :11], use_cache=True)
            cache = first.cache if CACHE_KWARG == "cache" else first.past_key_values
            second = m(input_ids=ids[:, 11:], attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache})
        assert cache.get_seq_length() == 20
        logits[tag] = torch.cat([first.logits, second.logits], dim=1)
    real = mask.bool()
    assert _rel(logits["ours"][real], logits["eager"][real]) <= LOSS_RTOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_on_every_kind_of_cache(gen, dtype):
    """decode_attention against float64 attention over each row's real keys: a full cache, left
    padding (the KV-cache kernel), a mask with holes and a cache that requires grad (the
    varlen fallback), a sliding window and softcap; GQA, a cache longer than the mask. The window
    counts positions in the row (eager's), also over holes."""
    batch, n_cache, n, heads, heads_k, dim = 3, 150, 131, 4, 2, 32
    q = torch.randn(batch, 1, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, n_cache, heads_k, dim, generator=gen).to(dtype) for _ in range(2))
    left = torch.ones(batch, n, dtype=torch.bool)
    left[0, :70], left[2, :1] = False, False
    holes = left.clone()
    holes[1, 20:90] = False
    holes_in_window = holes.clone()
    holes_in_window[1, 100:110], holes_in_window[2, 125] = False, False
    for mask, window, softcap, grad in ((None, (-1, -1), 0.0, False), (left, (-1, -1), 0.0, False),
                                        (left, (40, 0), 5.0, False), (holes, (-1, -1), 0.0, False),
                                        (left, (-1, -1), 0.0, True), (holes_in_window, (40, 0), 0.0, False),
                                        (holes_in_window, (40, 0), 5.0, True)):
        keys = torch.ones(batch, n_cache if mask is None else n, dtype=torch.bool) if mask is None else mask
        with torch.set_grad_enabled(grad):
            kk = k.clone().requires_grad_(grad)
            out = tvm_hf.decode_attention(q, kk, v, mask, softmax_scale=None, causal=True, window_size=window,
                                          softcap=softcap)
        for b in range(batch):
            idx = keys[b].nonzero()[:, 0]
            if window[0] >= 0:  # the query is at position len(keys) - 1
                idx = idx[idx >= len(keys[b]) - 1 - window[0]]
            kb, vb = (t[b, idx].double().repeat_interleave(heads // heads_k, 1) for t in (k, v))
            s = torch.einsum("hd,khd->hk", q[b, 0].double(), kb) / dim ** 0.5
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            want = torch.einsum("hk,khd->hd", s.softmax(-1), vb)
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            assert (out[b, 0].double() - want).abs().max() <= tol, (b, window, softcap, grad)


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_with_holes_in_the_mask_runs_the_kv_cache_kernel(gen, monkeypatch, batch):
    """A decode step whose mask has holes (generate() masks pad tokens inside a prompt) gathers
    each row's real keys for the KV-cache kernel rather than taking the varlen kernel (one query
    on 64-row tiles: ~30x slower in a model); rows of different real lengths, a cache longer than
    the mask, positions poisoned where the mask is False."""
    n_cache, n, heads, heads_k, dim = 90, 77, 4, 2, 32
    q = torch.randn(batch, 1, heads, dim, generator=gen)
    k, v = (torch.randn(batch, n_cache, heads_k, dim, generator=gen) for _ in range(2))
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, 5:30], mask[-1, 0], mask[-1, 40:41], mask[-1, 60:70] = False, False, False, False
    k[:, :n][~mask], v[:, :n][~mask] = float("nan"), float("nan")  # must never be read
    k[:, n:], v[:, n:] = float("nan"), float("nan")

    def refuse(*args, **kwargs):
        raise AssertionError("the decode step took the varlen kernel")

    monkeypatch.setattr(tvm_hf, "flash_attn_varlen_func", refuse)
    with torch.no_grad():
        out = tvm_hf.decode_attention(q, k, v, mask, softmax_scale=None, causal=True, window_size=(-1, -1),
                                      softcap=0.0)
    for b in range(batch):
        idx = mask[b].nonzero()[:, 0]
        kb, vb = (t[b, idx].double().repeat_interleave(heads // heads_k, 1) for t in (k, v))
        s = torch.einsum("hd,khd->hk", q[b, 0].double(), kb) / dim ** 0.5
        want = torch.einsum("hk,khd->hd", s.softmax(-1), vb)
        assert (out[b, 0].double() - want).abs().max() <= 2e-5, b
