"""Turn TVM's generated CUDA C into host C++ for the fiber emulator (emu_rt.h), plus an
``ARGS_<kernel>`` macro per kernel: its parameter names in order (harness.cpp calls by name)."""
import re
import sys


def split_top(s):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip()); cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def operand_exprs(section):
    # '"=r"(EXPR), "r"(EXPR)' -> [EXPR, ...]
    res = []
    for op in split_top(section):
        m = re.match(r'"[=+]?[rf]"\s*\((.*)\)\s*$', op, re.S)
        assert m, op
        res.append(m.group(1))
    return res


def match_paren(s, i):
    assert s[i] == "("
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "(":
            depth += 1
        elif s[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced")


def transform(src):
    # keep kernel definitions only
    start = src.index('extern "C" __global__')
    # skip prototypes (lines ending with ');')
    lines = src[start:].split("\n")
    body = []
    for ln in lines:
        if ln.startswith('extern "C" __global__') and ln.rstrip().endswith(");"):
            continue
        body.append(ln)
    s = "\n".join(body)

    def sig(m):
        params = split_top(m.group(2))
        new = []
        for p in params:
            pm = re.match(r"(\w+(?: \w+)?)\*\s*__restrict__\s+(\w+)", p)
            if pm:
                new.append(f"GPtr<{pm.group(1)}> {pm.group(2)}")
            else:
                new.append(p)
        return f"void {m.group(1)}({', '.join(new)}) {{"
    s = re.sub(r'extern "C" __global__ void __launch_bounds__\([\d, ]+\) (\w+)\((.*?)\) \{', sig, s)
    s = s.replace("extern __shared__ __align__(64) uchar buf_dyn_shmem_ptr[];", "uint8_t* buf_dyn_shmem_ptr = g_dyn_base;")
    s = re.sub(r"\(\((nv_bfloat16|half|float|uchar)\*\)buf_dyn_shmem_ptr\)", r"shp<\1>(buf_dyn_shmem_ptr)", s)
    s = re.sub(r"__shared__ alignas\(64\) (\w+) (\w+)\[(\d+)\];",
               lambda m: f'ShPtr<{m.group(1)}> {m.group(2)} = shp<{m.group(1)}>(emu_static_shared("{m.group(2)}", {m.group(3)} * sizeof({m.group(1)})));', s)
    # vector stores into shared memory
    out = ""
    i = 0
    pat = "*(uint4*)("
    while True:
        j = s.find(pat, i)
        if j < 0:
            out += s[i:]; break
        k = j + len(pat) - 1
        e = match_paren(s, k)
        inner = s[k + 1:e]
        out += s[i:j]
        if inner.startswith("shp<"):
            out += f"sh_vec_w<uint4>((void*)(&(({inner})[0])))"
        else:
            out += s[j:e + 1]
        i = e + 1
    s = out
    s = s.replace("unsigned int addr = __cvta_generic_to_shared(", "uintptr_t addr = (uintptr_t)(")

    # asm blocks
    def asm(m):
        text = m.group(0)
        instr = re.search(r'"((?:ldmatrix|mma)[^"]*)"', text).group(1)
        inner = text[text.index("(") + 1: text.rindex(")")]
        parts = split_top_colon(inner)
        outs, ins = operand_exprs(parts[1]), operand_exprs(parts[2])
        if instr.startswith("ldmatrix"):
            trans = "true" if ".trans" in instr else "false"
            assert len(outs) == 4 and len(ins) == 1
            r = "; ".join(f"{o} = _r[{n}]" for n, o in enumerate(outs))
            return f"{{ uint32_t _r[4]; emu_ldmatrix({trans}, {ins[0]}, _r); {r}; }}"
        bf = "true" if ".bf16." in instr else "false"
        assert ".f16.f16." in instr or ".bf16.bf16." in instr, instr
        assert len(outs) == 4 and len(ins) == 10
        a = ", ".join(ins[0:4]); b = ", ".join(ins[4:6]); c = ", ".join(ins[6:10])
        d = "; ".join(f"{o} = _d[{n}]" for n, o in enumerate(outs))
        return (f"{{ uint32_t _a[4] = {{{a}}}; uint32_t _b[2] = {{{b}}}; float _c[4] = {{{c}}}; float _d[4]; "
                f"emu_mma<{bf}>(_d, _a, _b, _c); {d}; }}")
    s = re.sub(r"__asm__ __volatile__\((?:[^;]|;\\n)*?\);", asm, s, flags=re.S)
    assert "__asm__" not in s
    # each kernel's parameter names, in order: the harness defines variables of these names
    params = re.findall(r'extern "C" __global__ void __launch_bounds__\([\d, ]+\) (\w+)\((.*?)\) \{', src)
    macros = "".join(f"#define ARGS_{name} {', '.join(p.split()[-1] for p in split_top(args))}\n"
                      for name, args in params)
    return '#include "emu_rt.h"\n' + s + "\n" + macros


def split_top_colon(s):
    out, depth, cur, instr = [], 0, "", False
    for ch in s:
        if ch == '"':
            instr = not instr
        if not instr:
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
        if ch == ":" and depth == 0 and not instr:
            out.append(cur); cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


if __name__ == "__main__":
    src = open(sys.argv[1]).read()
    open(sys.argv[2], "w").write(transform(src))
