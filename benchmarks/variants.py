"""Kernels that break one of the three rules on purpose, for the experiments in benchmarks/.

They are rewrites of the shipping kernels, made here and never shipped: the scheduled kernel is
printed as TVMScript, edited, and parsed back (TVM 0.27 exposes no TIR mutator to Python; the
printer and parser round-trip exactly, with ``show_meta``: the bf16 kernels' LLVM IR helper is a
long string the printer otherwise leaves out). The real kernels carry no experiment knobs.

* rule 1 (fp32 row statistics) needs no kernel: the experiment rounds the LSE the forward stored
  to fp16 before the backward reads it (``rule1_fp32_stats.py``);
* ``recompute_twice`` (rule 2): the backward recomputes S and P a second time, after dV, for
  dP, dS, dK and dQ: the naive structure that computes P once per use;
* ``low_precision_accumulators`` (rule 3): every running sum of dQ, dK and dV is rounded to a
  16-bit dtype after each update (bf16 by rounding the fp32 bits: TVM legalizes bf16 scratch
  buffers to fp32 on CPUs, which would silently undo it). AMX's products add into dK and dV
  inside their tile registers, so there is no update to round: on CPUs whose bf16 kernels take
  AMX the experiments call ``vector_products_for_experiments`` first.
"""

from __future__ import annotations

import os
import re

from tvm.script import from_source

from tvmflash import compiler, product_rates, target
from tvmflash.config import AMX, BF16_DOT
from tvmflash.spec import AttentionSpec

# The in-place running sums of the backward (kernels/cpu.py), by buffer written.
ACCUMULATORS = ("dQacc", "dKrun", "dVrun", "dKacc", "dVacc")


def _rounded(expr: str, dtype: str) -> str:
    """TVMScript for an fp32 expression rounded to ``dtype``, kept in fp32."""
    if dtype == "float16":
        return f'T.Cast("float32", T.Cast("float16", {expr}))'
    if dtype == "bfloat16":  # round half to even on the bits, keep the high 16
        bits = f'T.reinterpret("uint32", {expr})'
        lsb = f'T.bitwise_and(T.shift_right({bits}, T.uint32(16)), T.uint32(1))'
        return (f'T.reinterpret("float32", T.bitwise_and({bits} + T.uint32(32767) + {lsb}, '
                f'T.uint32(4294901760)))')
    raise ValueError(f"no {dtype} rounding")


def low_precision_accumulators(dtype: str):
    """A transform (for build.build_module) rounding the backward's running sums to ``dtype``."""

    def transform(kernel: str, func):
        if kernel != "backward":
            return func
        lines, count = [], 0
        for line in func.script(show_meta=True).splitlines():
            m = re.match(r"^(\s*)((" + "|".join(ACCUMULATORS) + r")\[[^=]*\]) = (\3\[.*\] \+ .*)$", line)
            if m:
                line, count = f"{m.group(1)}{m.group(2)} = {_rounded(m.group(4), dtype)}", count + 1
            lines.append(line)
        if count < len(ACCUMULATORS):
            raise RuntimeError(f"found {count} accumulator updates in the backward, expected {len(ACCUMULATORS)}")
        return from_source("\n".join(lines))

    return transform


def _stage_lines(lines: list[str], name: str) -> tuple[int, int]:
    """[first, end) of the ``for unit in range(1): with T.sblock("<name>_tile")`` statement."""
    at = next(i for i, line in enumerate(lines) if f'T.sblock("{name}_tile")' in line)
    start = at - 1
    assert lines[start].strip().startswith("for unit"), lines[start]
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    return start, end


def recompute_twice(kernel: str, func):
    """A transform (for build.build_module): the backward recomputes S and P again before dP."""
    if kernel != "backward":
        return func
    lines = func.script(show_meta=True).splitlines()
    copies = []
    for stage in ("scores", "probs"):
        start, end = _stage_lines(lines, stage)
        copies += [re.sub(r'T\.sblock\("(\w+?)(_tile)?"\)', r'T.sblock("\1_again\2")', line)
                   for line in lines[start:end]]
    at, _ = _stage_lines(lines, "dprobs")
    return from_source("\n".join(lines[:at] + copies + lines[at:]))


def vector_products_for_experiments() -> str | None:
    """Where this CPU's bf16 kernels would multiply on AMX tiles, make this process's bf16 kernels
    (shipping and variants alike) take the faster vector path instead ($TVMFLASH_BF16_PRODUCTS):
    the rule-3 variant needs the running sums' updates, which AMX keeps in tile registers.
    Returns the products chosen, or None where nothing changed."""
    if product_rates.bf16_products(target.host_target(), head_dim=64) != AMX:
        return None
    rates = product_rates.measured_rates()
    os.environ[product_rates.OVERRIDE_ENV] = product_rates.faster_products(rates) if rates else BF16_DOT
    return os.environ[product_rates.OVERRIDE_ENV]


def compile_variant(head_dim: int, dtype: str, transform, description: str):
    """The kernels for this CPU with a transform applied (hand-written configs, never cached)."""
    return compiler.build_transformed(AttentionSpec(head_dim, dtype), transform, description)
