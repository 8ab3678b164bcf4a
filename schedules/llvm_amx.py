"""AMX micro-kernels: the matrix products of ``products="amx"`` (Intel AMX-BF16, ``tdpbf16ps``).

One helper computes a block of ``mt x nt`` fp32 tiles (16 x 16 each) of ``C = A . B`` (or
``C += A . B``: the ``_acc`` helpers load C first) over a whole reduction of ``red`` bf16
elements, with the accumulators in tile registers throughout:

    C[16 mt, 16 nt] = sum over chunks c of A[16 mt, 32 c : 32 c + 32] . B[16 c : 16 c + 16, 16 nt]

``A`` is bf16 rows with the reduction along each row (uint16 bits), ``B`` pair words (uint32: a
bf16 pair of consecutive reduction indices, ``tvmflash/pair_words.py``), the operand layouts of
AMX's ``tdpbf16ps`` and of ``kernels/cpu.py: AmxTiles``. Strides are bytes. A 2 x 2 block
holds 4 accumulator tiles, 2 A tiles and 2 B tiles: all 8 tile registers. A reduction that is
a multiple of 16 but not of 32 ends on a half chunk (16 bf16: A tiles of 32 bytes a row, B
tiles of 8 rows).

How TVM 0.27 reaches the instructions: TIR has no tile type, so the helpers are LLVM IR
(``tileloadd64`` / ``tdpbf16ps`` / ``tilestored64`` in their ``.internal`` forms on
``x86_amx`` values, whose shapes are constants), generated per shape from the helper's name,
linked into the kernel's module by TVM's ``pragma_import_llvm`` attribute and inlined by LLVM.
LLVM's own passes place the tile configuration (``ldtilecfg``, once per function that uses
tiles) and allocate the tile registers. The kernels call them with ``T.call_extern`` on
pointers into their tile buffers (``kernels/cpu.py: AmxTiles.product``). Linux enables the
tile registers per process on request (``tvmflash/amx.py``) before any of this code may run.
"""

from __future__ import annotations

import re

from tvm import s_tir

from tvmflash.config import AMX_TILE as TILE  # rows of a tile; fp32 columns of an accumulator tile
CHUNK = 32  # bf16 elements of the reduction per tdpbf16ps (64 bytes: a full tile row)
HELPER_ATTR = "tvmflash_amx_helper"  # the annotation naming a product block's helper
_NAME = re.compile(r"tvmflash_amx_(\d)x(\d)_k(\d+)(_acc)?")


def helper_name(mt: int, nt: int, red: int, accumulate: bool = False) -> str:
    """The helper for ``mt x nt`` accumulator tiles over a reduction of ``red`` bf16 elements:
    ``C = A . B``, or ``C += A . B`` (``accumulate``: C's tiles loaded first)."""
    if mt not in (1, 2) or nt not in (1, 2) or red <= 0 or red % TILE:
        raise ValueError(f"no AMX helper for {mt} x {nt} tiles over {red} elements (1 or 2 tiles, a multiple of 16)")
    return f"tvmflash_amx_{mt}x{nt}_k{red}{'_acc' if accumulate else ''}"


def _chunks(red: int) -> list[int]:
    """Reduction bytes of each tdpbf16ps: whole 64-byte rows, and 32 for a last half chunk."""
    return [min(CHUNK, red - start) * 2 for start in range(0, red, CHUNK)]


def helper_ir(name: str) -> str:
    """The LLVM IR of a helper, from its name (``helper_name``)."""
    mt, nt, red, accumulate = _NAME.fullmatch(name).groups()
    mt, nt, red = int(mt), int(nt), int(red)
    lines = [f"define void @{name}(ptr %c, i64 %ldc, ptr %a, i64 %lda, ptr %b, i64 %ldb) {{"]

    def pointer(var, base, offset_expr):
        lines.append(f"  %{var}.o = {offset_expr}")
        lines.append(f"  %{var} = getelementptr i8, ptr {base}, i64 %{var}.o")

    acc = {}
    for m in range(mt):
        for n in range(nt):
            acc[m, n] = f"%acc.{m}.{n}.z"
            if accumulate:
                pointer(f"c0.{m}.{n}", "%c", f"mul i64 %ldc, {TILE * m}")
                lines.append(f"  %c0.{m}.{n}.n = getelementptr i8, ptr %c0.{m}.{n}, i64 {64 * n}")
                lines.append(f"  {acc[m, n]} = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, "
                             f"ptr %c0.{m}.{n}.n, i64 %ldc)")
            else:
                lines.append(f"  {acc[m, n]} = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)")
    offset = 0  # bytes into each A row
    for c, k_bytes in enumerate(_chunks(red)):
        for m in range(mt):
            pointer(f"a.{c}.{m}", "%a", f"mul i64 %lda, {TILE * m}")
            lines.append(f"  %a.{c}.{m}.k = getelementptr i8, ptr %a.{c}.{m}, i64 {offset}")
            lines.append(f"  %ta.{c}.{m} = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 {k_bytes}, "
                         f"ptr %a.{c}.{m}.k, i64 %lda)")
        for n in range(nt):
            pointer(f"b.{c}.{n}", "%b", f"mul i64 %ldb, {offset // 4}")
            lines.append(f"  %b.{c}.{n}.n = getelementptr i8, ptr %b.{c}.{n}, i64 {64 * n}")
            lines.append(f"  %tb.{c}.{n} = call x86_amx @llvm.x86.tileloadd64.internal(i16 {k_bytes // 4}, i16 64, "
                         f"ptr %b.{c}.{n}.n, i64 %ldb)")
        for m in range(mt):
            for n in range(nt):
                new = f"%acc.{m}.{n}.{c}"
                lines.append(f"  {new} = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 {k_bytes}, "
                             f"x86_amx {acc[m, n]}, x86_amx %ta.{c}.{m}, x86_amx %tb.{c}.{n})")
                acc[m, n] = new
        offset += k_bytes
    for m in range(mt):
        for n in range(nt):
            pointer(f"c.{m}.{n}", "%c", f"mul i64 %ldc, {TILE * m}")
            lines.append(f"  %c.{m}.{n}.n = getelementptr i8, ptr %c.{m}.{n}, i64 {64 * n}")
            lines.append(f"  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c.{m}.{n}.n, i64 %ldc, "
                         f"x86_amx {acc[m, n]})")
    lines.append("  ret void\n}")
    return "\n".join(lines) + "\n"


_DECLARATIONS = """
declare x86_amx @llvm.x86.tilezero.internal(i16, i16)
declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)
"""


def import_helpers(sch: s_tir.Schedule, loop, products: tuple[str, ...]) -> None:
    """Link the helpers that the kernel's product blocks (named ``products``) call into its
    module (``pragma_import_llvm`` on ``loop``; LLVM inlines them). Only AMX kernels call them:
    they reach LLVM only for targets with AMX-BF16 (``compiler.choose_configs`` refuses ``amx``
    configs elsewhere)."""
    names = sorted({str(sch.get(sch.get_sblock(block)).annotations[HELPER_ATTR]) for block in products})
    sch.annotate(loop, "pragma_import_llvm", "".join(helper_ir(name) for name in names) + _DECLARATIONS)
