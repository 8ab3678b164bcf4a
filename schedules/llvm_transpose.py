"""16 x 16 fp32 block transposes in registers: the fp32 forward's query load and output store.

The forward keeps its tiles transposed (query index in the vector lanes, ``kernels/cpu.py``),
while q and out hold a query's head dim contiguously. Element by element, the load writes Q^T
and the store reads O^T at a stride of the tile's rows: one scalar store (or load) per element,
10-20 % of a short call's forward (DEVELOPING.md, "Where a small forward's time goes"). These
helpers move a 16 x 16 block with 16 vector loads, 64 two-source shuffles and 16 vector stores.

The shuffles are target-independent LLVM IR (``shufflevector`` on ``<16 x float>``): LLVM picks
the instructions (AVX-512 ``vpermt2ps``; two halves on AVX2; four quarters on NEON). The network
swaps the off-diagonal b x b blocks of every 2b x 2b block for b = 8, 4, 2, 1: row r and row
r + b (bit b of r clear) become

    new_r[c] = row_{r+b}[c - b] if c & b else row_r[c]
    new_{r+b}[c] = row_{r+b}[c] if c & b else row_r[c + b]

and after the four levels element (r, c) sits at (c, r). As the AMX helpers are
(``llvm_amx.py``), they are linked into the kernel's module by TVM's ``pragma_import_llvm``
(``import_helpers``) and inlined by LLVM; the kernel calls them with ``T.call_extern`` on
pointers, strides in elements.
"""

from __future__ import annotations

from tvm import s_tir

EDGE = 16  # rows and columns of a block
HELPER_ATTR = "tvmflash.transpose_helpers"  # the function attribute of kernels that call them
LOAD = "tvmflash_transpose_16x16"  # dst[r, c] = src[c, r]
STORE_SCALED = "tvmflash_transpose_16x16_scaled"  # dst[r, c] = src[c, r] * scale[r]


def _shuffle_network(rows: list[str], lines: list[str]) -> list[str]:
    """IR lines that transpose the 16 <16 x float> values ``rows``; returns the result's names."""
    b = EDGE // 2
    while b:
        new = list(rows)
        for r in range(EDGE):
            if r & b:
                continue
            low = [c if not c & b else EDGE + c - b for c in range(EDGE)]  # (indices >= 16: the second operand)
            high = [c + b if not c & b else EDGE + c for c in range(EDGE)]
            for target, mask in ((r, low), (r + b, high)):
                name = f"%t{b}.{target}"
                indices = ", ".join(f"i32 {i}" for i in mask)
                lines.append(f"  {name} = shufflevector <16 x float> {rows[r]}, <16 x float> {rows[r + b]}, "
                             f"<16 x i32> <{indices}>")
                new[target] = name
        rows, b = new, b // 2
    return rows


def _helper(name: str, scaled: bool) -> str:
    params = "ptr %dst, i64 %ldd, ptr %src, i64 %lds" + (", ptr %scale" if scaled else "")
    lines = [f"define void @{name}({params}) {{"]
    rows = []
    if scaled:
        lines.append("  %s = load <16 x float>, ptr %scale, align 4")
    for r in range(EDGE):
        lines.append(f"  %so{r} = mul i64 %lds, {r}")
        lines.append(f"  %sp{r} = getelementptr float, ptr %src, i64 %so{r}")
        lines.append(f"  %a{r} = load <16 x float>, ptr %sp{r}, align 4")
        if scaled:  # (the scale is per column of src: per lane, before the transpose)
            lines.append(f"  %as{r} = fmul <16 x float> %a{r}, %s")
        rows.append(f"%as{r}" if scaled else f"%a{r}")
    for r, value in enumerate(_shuffle_network(rows, lines)):
        lines.append(f"  %do{r} = mul i64 %ldd, {r}")
        lines.append(f"  %dp{r} = getelementptr float, ptr %dst, i64 %do{r}")
        lines.append(f"  store <16 x float> {value}, ptr %dp{r}, align 4")
    lines.append("  ret void\n}")
    return "\n".join(lines) + "\n"


HELPERS_LL = _helper(LOAD, False) + _helper(STORE_SCALED, True)


def import_helpers(sch: s_tir.Schedule, loop) -> None:
    """Link the helpers into the function of ``loop`` (``pragma_import_llvm``; kernels with the
    function attribute ``HELPER_ATTR`` call them)."""
    sch.annotate(loop, "pragma_import_llvm", HELPERS_LL)
