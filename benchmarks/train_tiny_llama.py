"""Training evidence for rules 1 and 3: one small Llama trained four times, same init, same batches.

    python benchmarks/train_tiny_llama.py                      # the real run (300 steps, ~2 h on a busy 2-core VM): docs/
    python benchmarks/train_tiny_llama.py --quick --out-dir D  # seq 128, 2 layers, 3 steps (< 1 min)

Model: transformers' ``LlamaConfig`` with random weights (seed 0, no download), byte-level
vocabulary (256 tokens), GQA. Text: the Python standard library's own ``*.py`` files (real text
on every machine, no network), read in sorted order; every 20th file is held out for validation.

Precision: fp32 master weights and AdamW state, forward and backward under CPU autocast to
bfloat16, the usual mixed-precision recipe: attention gets bf16 q, k, v, and the kernels' row
statistics and gradient accumulators are where rules 1 and 3 apply. RoPE hands attention fp32 q
and k; SDPA and tvmflash's op both follow autocast and run on them cast to bf16.

The four runs:
  sdpa             transformers' ``sdpa`` attention (PyTorch's CPU flash kernel)
  tvmflash         ``attn_implementation=tvmflash.integrations.transformers.register()``
  fp16 LSE         tvmflash's kernels, the LSE the forward stored rounded to fp16 before the
                   backward reads it (rule 1 broken, as in ``rule1_fp32_stats.py``)
  bf16 accumulators  tvmflash's backward with its dQ/dK/dV running sums rounded to bf16 after
                   every update (rule 3 broken: ``variants.low_precision_accumulators``)

The runs step in lock-step: each step draws one batch and every run trains on it, in an order
rotated per step, so that the step times of sdpa and tvmflash are measured under the same load.
Before training, checks on the first batch from the common init: sdpa vs tvmflash in fp32 and in
bf16, the experiment's attention wrapper (with the shipping kernels, nothing rounded) vs the
integration (bit-identical expected), and that the variants really change the gradients.
"""

from __future__ import annotations

import copy
import csv
import math
import os
import sysconfig
import time
from pathlib import Path

import torch

from common import markdown_table, out_dir, parser, plt, write_report
from tvmflash import torch_op
from tvmflash.integrations import transformers as tvm_hf
from variants import compile_variant, low_precision_accumulators, vector_products_for_experiments

NAME = "train_tiny_llama"
SDPA, TVMFLASH, LSE16, ACC16 = "sdpa", "tvmflash", "fp16 LSE", "bf16 accumulators"
RUNS = (SDPA, TVMFLASH, LSE16, ACC16)
EXPERIMENT_NAMES = {LSE16: "tvm_rule1_lse_fp16", ACC16: "tvm_rule3_bf16_acc", "control": "tvm_experiment_control"}
AUTOCAST = torch.bfloat16

FULL = dict(hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2, seq=1024, batch=4, steps=300,
            warmup=30, lr=2e-3, eval_every=25, eval_batches=8)
QUICK = dict(hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, seq=128, batch=2, steps=3,
             warmup=1, lr=2e-3, eval_every=3, eval_batches=2)


# --- data: the standard library's source, bytes as tokens ----------------------------------------
def stdlib_corpus(holdout_every: int = 20) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, validation bytes, description): every ``holdout_every``-th file (sorted by
    path) is validation text, the rest training text; files are separated by a blank line."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    parts = {"train": [], "val": []}
    for i, path in enumerate(files):
        parts["val" if i % holdout_every == 0 else "train"].append(path.read_bytes() + b"\n\n")
    streams = {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8) for k, v in parts.items()}
    about = {"root": str(root), "files": len(files), "train_bytes": streams["train"].numel(),
             "val_bytes": streams["val"].numel()}
    return streams["train"], streams["val"], about


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return torch.stack([stream[s:s + length] for s in starts.tolist()]).long()


# --- the rule-1 and rule-3 variants: tvmflash's kernels behind a transformers attention function --
class LseStats:
    """What rounding the stored LSE to fp16 did: max |LSE| and max |LSE - fp16(LSE)| over the
    forwards since the last ``take()``."""

    def __init__(self):
        self.max_abs_lse = self.max_rounding = 0.0

    def update(self, lse: torch.Tensor, stored: torch.Tensor) -> None:
        self.max_abs_lse = max(self.max_abs_lse, lse.abs().max().item())
        self.max_rounding = max(self.max_rounding, (lse - stored).abs().max().item())

    def take(self) -> tuple[float, float]:
        seen = (self.max_abs_lse, self.max_rounding)
        self.__init__()
        return seen


class KernelAttention(torch.autograd.Function):
    """Causal attention through a set of tvmflash kernels, the LSE optionally stored rounded."""

    @staticmethod
    def forward(ctx, q, k, v, kernels, scale, lse_dtype, stats):
        batch, seqlen, heads, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seqlen, dtype=torch.float32)
        kernels.forward(q, k, v, out, lse, scale, causal=True)
        if lse_dtype is not None:  # what storing it in lse_dtype would keep
            stored = lse.to(lse_dtype).float()
            stats.update(lse, stored)
            lse = stored
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels, ctx.scale = kernels, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:  # the kernels read any strides but a unit head_dim stride
            dout = dout.contiguous()
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        ctx.kernels.backward(dout, q, k, v, out, lse, dq, dk, dv, ctx.scale, causal=True)
        return dq, dk, dv, None, None, None, None


def experiment_attention(kernels_for, lse_dtype=None, stats=None):
    """A transformers attention function (``AttentionInterface``) running ``kernels_for(q)``."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if attention_mask is not None or dropout or not getattr(module, "is_causal", True):
            raise NotImplementedError("the experiment wrapper does causal attention without padding only")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, head_dim) views
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
        q, k, v = (t.to(dtype) for t in (q, k, v))
        out = KernelAttention.apply(q, k, v, kernels_for(q), scaling, lse_dtype, stats)
        return out, None

    return attention


def register_runs(lse_stats: LseStats) -> dict:
    """attn_implementation name of each run (and of the control: the wrapper, nothing changed)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    names = {SDPA: "sdpa", TVMFLASH: tvm_hf.register()}
    shipping = lambda q: torch_op.kernels_for(q, causal=True)  # noqa: E731 - what flash_attn_func runs
    accumulators = {}

    def bf16_accumulators(q):
        if q.dtype not in accumulators:
            dtype = str(q.dtype).removeprefix("torch.")
            variant = compile_variant(q.shape[-1], dtype, low_precision_accumulators("bfloat16"),
                                      "bf16 accumulators")
            if variant.configs != shipping(q).configs:  # the rounding must be the only difference
                raise RuntimeError(f"variant configs {variant.configs} differ from {shipping(q).configs}")
            accumulators[q.dtype] = variant
        return accumulators[q.dtype]

    functions = {LSE16: experiment_attention(shipping, torch.float16, lse_stats),
                 ACC16: experiment_attention(bf16_accumulators),
                 "control": experiment_attention(shipping)}
    for run, fn in functions.items():
        AttentionInterface.register(EXPERIMENT_NAMES[run], fn)
        AttentionMaskInterface.register(EXPERIMENT_NAMES[run], tvm_hf.key_padding_mask)  # None: no padding
        names[run] = EXPERIMENT_NAMES[run]
    return names


# --- model and training ----------------------------------------------------------------------------
def llama_config(size: dict):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                       num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                       num_key_value_heads=size["kv_heads"], max_position_embeddings=size["seq"],
                       attention_dropout=0.0, tie_word_embeddings=False)


def build_model(config, attn_implementation: str, state: dict):
    from transformers import AutoModelForCausalLM

    # from_config writes the implementation into the config: one copy per model
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
    model.load_state_dict(state)
    assert model.config._attn_implementation == attn_implementation
    return model


def learning_rate(step: int, size: dict) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < size["warmup"]:
        return size["lr"] * (step + 1) / size["warmup"]
    progress = (step - size["warmup"]) / max(1, size["steps"] - size["warmup"])
    return size["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_and_grads(model, batch: torch.Tensor, autocast: bool) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", AUTOCAST, enabled=autocast):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def max_gradient_difference(grads: dict, ref: dict) -> float:
    """max over parameters of |g - ref| / |ref| (norms)."""
    return max(((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item() for n in ref)


def initial_checks(config, state, names, batch) -> dict:
    """From the common init, on the first batch: are the runs what they claim to be?"""
    model = build_model(config, "sdpa", state)
    results = {}
    for autocast in (False, True):
        model.set_attn_implementation("sdpa")
        ref_loss, ref_grads = loss_and_grads(model, batch, autocast)
        model.set_attn_implementation(names[TVMFLASH])
        loss, grads = loss_and_grads(model, batch, autocast)
        key = "bf16" if autocast else "fp32"
        results[f"sdpa_vs_tvmflash_{key}"] = {"loss_sdpa": ref_loss, "loss_tvmflash": loss,
                                               "loss_rel": relative_difference(loss, ref_loss),
                                               "grad_rel": max_gradient_difference(grads, ref_grads)}
    # bf16 from here on, against the integration's (b) gradients
    for run in ("control", LSE16, ACC16):
        model.set_attn_implementation(names[run])
        loss_v, grads_v = loss_and_grads(model, batch, True)
        results[f"{run}_vs_tvmflash_bf16"] = {"loss_rel": relative_difference(loss_v, loss),
                                              "grad_rel": max_gradient_difference(grads_v, grads),
                                              "bit_identical": loss_v == loss and all(
                                                  torch.equal(grads_v[n], grads[n]) for n in grads)}
    return results


class Run:
    """One of the four trainings: its model, optimizer and history."""

    def __init__(self, name: str, model, size: dict):
        self.name, self.model = name, model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=size["lr"], betas=(0.9, 0.95), weight_decay=0.1)
        self.losses, self.grad_norms, self.seconds, self.val = [], [], [], []

    def train_step(self, batch: torch.Tensor, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        start = time.perf_counter()
        with torch.autocast("cpu", AUTOCAST):
            loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.seconds.append(time.perf_counter() - start)
        self.losses.append(loss.item())
        self.grad_norms.append(norm.item())

    @torch.no_grad()
    def validate(self, batches: list[torch.Tensor]) -> float:
        self.model.eval()
        with torch.autocast("cpu", AUTOCAST):
            losses = [self.model(input_ids=b, labels=b).loss.item() for b in batches]
        return sum(losses) / len(losses)


def pause() -> None:
    """Let the other runtime's OpenMP workers stop spinning before a timed step (DEVELOPING.md)."""
    time.sleep(0.02)


# --- report ------------------------------------------------------------------------------------------
def step_windows(steps: int, count: int = 5) -> list[tuple[int, int]]:
    edges = [round(i * steps / count) for i in range(count + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def median(values: list[float]) -> float:
    s = sorted(values)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def difference_table(runs: dict, against: str, compared: list[str], steps: int) -> tuple[list, list]:
    ref = runs[against].losses
    spans = step_windows(steps)
    headers = ["run", *(f"mean abs Δ, steps {a}-{b - 1}" for a, b in spans), "mean Δ, last window",
               "final Δ (last step)", "max abs Δ (step)"]
    rows = []
    for name in compared:
        delta = [x - r for x, r in zip(runs[name].losses, ref)]
        worst = max(range(len(delta)), key=lambda i: abs(delta[i]))
        last = spans[-1]
        rows.append([f"{name} - {against}", *(f"{sum(abs(d) for d in delta[a:b]) / (b - a):.4f}" for a, b in spans),
                     f"{sum(delta[last[0]:last[1]]) / (last[1] - last[0]):+.4f}", f"{delta[-1]:+.4f}",
                     f"{abs(delta[worst]):.4f} ({worst})"])
    return headers, rows


def summary(runs: dict, val_steps: list[int], steps: int) -> str:
    """The run's differences in one sentence, with tvmflash - sdpa (two correct implementations whose
    trajectories part through rounding alone) as the yardstick."""
    def mean_abs_delta(name, start=0):
        pairs = list(zip(runs[name].losses, runs[SDPA].losses))[start:]
        return sum(abs(x - r) for x, r in pairs) / len(pairs)

    def mean_delta(name, start):
        pairs = list(zip(runs[name].losses, runs[SDPA].losses))[start:]
        return sum(x - r for x, r in pairs) / len(pairs)

    last = step_windows(steps)[-1][0]
    floor = mean_abs_delta(TVMFLASH)
    parts = [f"tvmflash - sdpa (the noise floor): mean |Δ| {floor:.4f} over the run, mean Δ over steps "
             f"{last}-{steps - 1} {mean_delta(TVMFLASH, last):+.4f}, final validation Δ "
             f"{runs[TVMFLASH].val[-1] - runs[SDPA].val[-1]:+.4f}"]
    for name in (LSE16, ACC16):
        parts.append(f"{name} - sdpa: mean |Δ| {mean_abs_delta(name):.4f} ({mean_abs_delta(name) / floor:.1f}x the "
                     f"floor), mean Δ over steps {last}-{steps - 1} {mean_delta(name, last):+.4f}, final validation Δ "
                     f"{runs[name].val[-1] - runs[SDPA].val[-1]:+.4f}")
    return "; ".join(parts) + f" (validation after step {val_steps[-1]}, loss {runs[SDPA].val[-1]:.4f} for sdpa)."


def write_csvs(directory: Path, runs: dict, lrs: list[float], val_steps: list[int], loads: list[float]) -> None:
    with open(directory / f"{NAME}_steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "lr", *(f"loss[{n}]" for n in runs), *(f"grad_norm[{n}]" for n in runs),
                    *(f"seconds[{n}]" for n in runs), "loadavg_1min"])
        for i, lr in enumerate(lrs):
            w.writerow([i, f"{lr:.6g}", *(f"{r.losses[i]:.6f}" for r in runs.values()),
                        *(f"{r.grad_norms[i]:.5g}" for r in runs.values()),
                        *(f"{r.seconds[i]:.4f}" for r in runs.values()), f"{loads[i]:.2f}"])
    with open(directory / f"{NAME}_val.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *(f"val_loss[{n}]" for n in runs)])
        for i, step in enumerate(val_steps):
            w.writerow([step, *(f"{r.val[i]:.6f}" for r in runs.values())])


def plot(runs: dict, val_steps: list[int], title: str):
    pyplot = plt()
    figure, (top, bottom) = pyplot.subplots(2, 1, figsize=(8, 8), sharex=True)
    styles = {SDPA: ("black", "-"), TVMFLASH: ("tab:blue", "--"), LSE16: ("tab:red", "-"),
              ACC16: ("tab:green", "-")}
    for name, run in runs.items():
        color, line = styles[name]
        top.plot(run.losses, color=color, linestyle=line, linewidth=0.8, label=f"{name} (train)")
        top.plot(val_steps, run.val, color=color, linestyle=line, marker="o", markersize=3, label=f"{name} (val)")
        if name != SDPA:
            delta = [x - r for x, r in zip(run.losses, runs[SDPA].losses)]
            bottom.plot(delta, color=color, linewidth=0.4, alpha=0.4)
            span = max(1, min(25, len(delta) // 10))  # steps per moving average
            smooth = [sum(delta[max(0, i + 1 - span):i + 1]) / min(span, i + 1) for i in range(len(delta))]
            bottom.plot(smooth, color=color, linestyle=line, linewidth=1.5, label=f"{name} - sdpa ({span}-step mean)")
    top.set_ylabel("loss (nats per byte)")
    top.set_title(title)
    top.legend(fontsize=7, ncol=2)
    top.grid(True, alpha=0.3)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("train loss - sdpa's (same batch)")
    bottom.legend(fontsize=7)
    bottom.grid(True, alpha=0.3)
    figure.tight_layout()
    return figure


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 300, quick: 3)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 4, quick: 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 1024, quick: 128)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between validations")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if vector_products_for_experiments():  # (AMX keeps the sums the bf16 variant rounds in tile registers)
        print(f"bf16 kernels on {os.environ['TVMFLASH_BF16_PRODUCTS']} products in this experiment, not AMX")
    size = dict(QUICK if args.quick else FULL)
    for key in ("steps", "batch", "seq", "eval_every"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    directory = out_dir(args)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)

    train_text, val_text, corpus = stdlib_corpus()
    seq, batch_size = size["seq"], size["batch"]
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [windows(val_text, torch.randint(0, val_text.numel() - seq, (batch_size,), generator=data_gen), seq)
                   for _ in range(size["eval_batches"])]

    def train_batch() -> torch.Tensor:
        return windows(train_text, torch.randint(0, train_text.numel() - seq, (batch_size,), generator=data_gen), seq)

    lse_stats = LseStats()
    names = register_runs(lse_stats)
    config = llama_config(size)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM
    init = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").state_dict()
    parameters = sum(t.numel() for t in init.values())
    print(f"corpus: {corpus}; model: {parameters / 1e6:.2f}M parameters, {size}", flush=True)

    first = train_batch()
    checks = initial_checks(config, init, names, first)
    print(f"initial checks: {checks}", flush=True)

    runs = {name: Run(name, build_model(config, names[name], init), size) for name in RUNS}
    lrs, loads, val_steps, lse_per_step = [], [], [], []
    started = time.time()
    for step in range(size["steps"]):
        batch = first if step == 0 else train_batch()
        lr = learning_rate(step, size)
        lrs.append(lr)
        order = RUNS[step % len(RUNS):] + RUNS[:step % len(RUNS)]  # rotated: no run always first
        for name in order:
            pause()
            if name == LSE16:
                lse_stats.take()  # forget the forwards of validation and checks
            runs[name].train_step(batch, lr)
            if name == LSE16:
                lse_per_step.append(lse_stats.take())
        loads.append(os.getloadavg()[0])
        if step % size["eval_every"] == 0 or step == size["steps"] - 1:
            val_steps.append(step)
            for name in order:
                runs[name].val.append(runs[name].validate(val_batches))
        line = " ".join(f"{n}={runs[n].losses[-1]:.4f} ({runs[n].seconds[-1]:.2f}s)" for n in RUNS)
        val = f" val: {' '.join(f'{runs[n].val[-1]:.4f}' for n in RUNS)}" if val_steps and val_steps[-1] == step else ""
        print(f"step {step} lr {lr:.2e} load {loads[-1]:.2f} {line}{val} [{time.time() - started:.0f}s]", flush=True)

    # --- what the run shows -------------------------------------------------------------------------
    finite = {n: all(math.isfinite(x) for x in r.losses + r.val) for n, r in runs.items()}
    tokens = batch_size * seq
    timed = range(min(3, size["steps"] - 1), size["steps"])  # the first steps allocate and warm up
    tok_s = {n: tokens / median([r.seconds[i] for i in timed]) for n, r in runs.items()}
    paired = median([runs[SDPA].seconds[i] / runs[TVMFLASH].seconds[i] for i in timed])
    headers, rows = difference_table(runs, SDPA, [TVMFLASH, LSE16, ACC16], size["steps"])
    _, rows_b = difference_table(runs, TVMFLASH, [LSE16, ACC16], size["steps"])
    val_rows = [[step, *(f"{runs[n].val[i]:.4f}" for n in RUNS),
                 *(f"{runs[n].val[i] - runs[SDPA].val[i]:+.4f}" for n in RUNS[1:])]
                for i, step in enumerate(val_steps)]
    val_headers = ["after step", *(f"val {n}" for n in RUNS), *(f"{n} - sdpa" for n in RUNS[1:])]
    speed_rows = [[n, f"{tok_s[n]:,.0f}", f"{median([runs[n].seconds[i] for i in timed]):.2f}"] for n in RUNS]
    c = checks
    body = (
        f"Model: Llama from `LlamaConfig` (random init, seed {args.seed}), {parameters / 1e6:.2f}M parameters: "
        f"hidden {size['hidden']}, {size['layers']} layers, {size['heads']} heads / {size['kv_heads']} KV heads "
        f"(head dim {size['hidden'] // size['heads']}), MLP {size['intermediate']}, vocab 256 (bytes). "
        f"Text: {corpus['files']} stdlib `*.py` files ({corpus['root']}), {corpus['train_bytes'] / 1e6:.1f} MB "
        f"train, {corpus['val_bytes'] / 1e6:.1f} MB validation (every 20th file). {size['steps']} steps of "
        f"{batch_size} x {seq} tokens, AdamW (lr {size['lr']:g}, betas 0.9/0.95, wd 0.1), {size['warmup']} warmup "
        f"steps then cosine to lr/10, gradient clipping at 1.0. fp32 weights, bf16 autocast (attention in bf16). "
        f"Validation: {size['eval_batches']} x {batch_size} x {seq} held-out tokens every {size['eval_every']} steps."
        f"\n\nChecks from the common init on the first batch: sdpa vs tvmflash in fp32: loss "
        f"{c['sdpa_vs_tvmflash_fp32']['loss_rel']:.1e} relative, gradients {c['sdpa_vs_tvmflash_fp32']['grad_rel']:.1e} "
        f"(max relative norm over parameters); in bf16: {c['sdpa_vs_tvmflash_bf16']['loss_rel']:.1e}, "
        f"{c['sdpa_vs_tvmflash_bf16']['grad_rel']:.1e}. Against tvmflash's bf16 gradients: the experiment wrapper "
        f"with the shipping kernels {'is bit-identical' if c['control_vs_tvmflash_bf16']['bit_identical'] else 'DIFFERS'}; "
        f"fp16 LSE {c[f'{LSE16}_vs_tvmflash_bf16']['grad_rel']:.1e}, bf16 accumulators "
        f"{c[f'{ACC16}_vs_tvmflash_bf16']['grad_rel']:.1e}. Over the training, the fp16-LSE run rounded the stored LSE "
        f"by up to {max(r for _, r in lse_per_step):.2e} (max |LSE| {lse_per_step[0][0]:.2f} at step 0, "
        f"{max(a for a, _ in lse_per_step):.2f} at most, {lse_per_step[-1][0]:.2f} at the last step).\n\n"
        "Train-loss differences (same batch each step; Δ = run - reference, nats per byte):\n\n"
        + markdown_table(headers, rows + rows_b)
        + "\n\nValidation loss:\n\n" + markdown_table(val_headers, val_rows)
        + f"\n\nWhole training step (forward, backward, clipping, AdamW), medians over steps {timed.start}-"
          f"{timed.stop - 1}, runs interleaved per step in rotated order; tvmflash vs sdpa paired per step: "
          f"{paired:.2f}x sdpa's speed. Load average (1 min) during the run: min {min(loads):.1f}, "
          f"median {median(loads):.1f}, max {max(loads):.1f} (this run itself keeps ~2 busy).\n\n"
        + markdown_table(["run", "tokens/s", "seconds/step"], speed_rows)
        + f"\n\n**Conclusion:** {summary(runs, val_steps, size['steps'])}")
    data = {"size": size, "seed": args.seed, "parameters": parameters, "corpus": corpus, "checks": checks,
            "lse_per_step": {"max_abs_lse": [a for a, _ in lse_per_step],
                             "max_rounding": [r for _, r in lse_per_step]},
            "finite": finite, "lr": lrs, "loadavg": loads, "val_steps": val_steps,
            "tokens_per_second": tok_s, "tvmflash_over_sdpa_speed": paired,
            "runs": {n: {"loss": r.losses, "grad_norm": r.grad_norms, "seconds": r.seconds, "val": r.val}
                     for n, r in runs.items()}}
    figure = None
    if directory is not None:
        write_csvs(directory, runs, lrs, val_steps, loads)
        try:
            figure = plot(runs, val_steps, f"Tiny Llama, {size['steps']} steps of {batch_size} x {seq} bytes, "
                                           "bf16 autocast")
        except ImportError:  # matplotlib is optional: the tables and CSVs are the record
            print("matplotlib not installed: no plot", flush=True)
    write_report(directory, NAME, "Training a tiny Llama: rules 1 and 3 at small scale", body, figure, data)
    return 0 if all(finite.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
