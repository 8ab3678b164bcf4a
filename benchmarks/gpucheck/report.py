"""The report: a summary (the issue's bar, correctness counts) and the markdown printed last."""

from __future__ import annotations

BAR_KEYS = ("bar_N8K_D128_bf16", "bar_N8K_D128_bf16_causal")


def _fmt_tf(x) -> str:
    return "-" if x is None else (f"{x:.1f}" if x >= 1 else f"{x:.3f}")


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b} B"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def compile_summary(stage: dict) -> str:
    cases = stage.get("cases", [])
    ok = [c for c in cases if c.get("ok")]
    longest = max((c.get("compile_s", 0) for c in ok), default=0)
    line = (f"compile: {len(ok)}/{len(cases)} variants ready in {stage.get('elapsed_s', 0):.0f} s "
            f"(slowest {longest:.0f} s)")
    bad = [f"{c['label']}: {c.get('error', '?')[:200]}" for c in cases if not c.get("ok")]
    return line + "".join(f"\n  FAILED {b}" for b in bad)


def summarize(report: dict) -> dict:
    stages = report["stages"]
    out = {}
    corr = stages.get("correctness")
    if corr:
        cases = corr.get("cases", [])
        out["correctness_passed"] = sum(bool(c.get("ok")) for c in cases)
        out["correctness_total"] = len(cases) + len(corr.get("skipped", []))
        out["correctness_failed"] = [c["label"] for c in cases if not c.get("ok")]
    for rec in (stages.get("speed") or {}).get("cases", []):
        c = rec.get("case", {})
        r = rec.get("ratio", {}).get("sdpa_flash")
        if (c.get("seqlen"), c.get("head_dim"), c.get("dtype")) == (8192, 128, "bfloat16") and r:
            out[BAR_KEYS[bool(c["causal"])]] = {"fwd": r["fwd"], "bwd": r["bwd"], "fwd+bwd": r["fwd+bwd"],
                                                "meets_0.5x": r["fwd"] >= 0.5 and (r["bwd"] or 0) >= 0.5}
    return out


def render_correctness(corr: dict) -> list[str]:
    cases = corr.get("cases", [])
    passed = [c for c in cases if c.get("ok")]
    worst = max((max((ch.get("ratio", 0) for ch in c.get("checks", {}).values()), default=0), c["label"])
                for c in passed) if passed else None
    lines = [f"correctness: {len(passed)}/{len(cases)} passed"
             + (f", {len(corr['skipped'])} skipped" if corr.get("skipped") else "")
             + (f"; worst err/bound {worst[0]:.2f} ({worst[1]})" if worst else "")]
    for c in [c for c in cases if not c.get("ok")][:12]:
        if "error" in c:
            why = c["error"].splitlines()[0][:200]
        else:
            why = ", ".join(f"{k} err {v.get('err', float('nan')):.3g} > bound {v.get('bound', float('nan')):.3g}"
                            if "err" in v else f"{k}: {v.get('error', 'failed')}"
                            for k, v in c.get("checks", {}).items() if not v.get("ok"))
        lines.append(f"  FAILED {c['label']}: {why}")
    return lines


def render_speed(speed: dict) -> list[str]:
    records = speed.get("cases", [])
    refs = list(dict.fromkeys(name for rec in records for name in rec.get("tflops", {}) if name != "tvmflash"))
    short = [r.removeprefix("sdpa_") for r in refs]
    head = (["case", "ours fwd"] + [f"{r} fwd" for r in short] + ["ours f+b"] + [f"{r} f+b" for r in short]
            + [f"fwd/{r}" for r in short] + [f"bwd/{r}" for r in short[:1]] + [f"f+b/{r}" for r in short])
    rows = []
    for rec in records:
        if "tflops" not in rec:
            error = "ERROR: " + rec.get("error", "?").splitlines()[0][:120]
            rows.append([rec["label"], error] + [""] * (len(head) - 2))
            continue
        tf, ratio = rec["tflops"], rec.get("ratio", {})
        flag = " NaN!" if rec.get("ours_nan") else " MISMATCH!" if rec.get("out_matches_ref") is False else ""
        rows.append([rec["label"] + flag, _fmt_tf(tf["tvmflash"]["fwd"])]
                    + [_fmt_tf(tf.get(r, {}).get("fwd")) for r in refs] + [_fmt_tf(tf["tvmflash"]["fwd+bwd"])]
                    + [_fmt_tf(tf.get(r, {}).get("fwd+bwd")) for r in refs]
                    + [_ratio(ratio.get(r, {}).get("fwd")) for r in refs]
                    + [_ratio(ratio.get(r, {}).get("bwd")) for r in refs[:1]]
                    + [_ratio(ratio.get(r, {}).get("fwd+bwd")) for r in refs])
    lines = ["", "speed (TFLOP/s; ratios ours/ref, > 1: tvmflash faster):",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    unavailable = sorted({f"{k}: {v[:100]}" for rec in records for k, v in rec.get("unavailable", {}).items()})
    lines += [f"  unavailable {u}" for u in unavailable[:6]]
    if speed.get("skipped"):
        lines.append(f"  {len(speed['skipped'])} speed case(s) skipped: {speed['skipped'][0]['why']}")
    return lines


def render_long(rec: dict) -> str:
    if "error" in rec:
        return f"{rec['label']}: FAILED {rec['error'].splitlines()[0][:200]}"
    std = rec["standard_attention"]
    text = f"{rec['label']}: fwd {rec.get('fwd_s', float('nan')):.2f} s ({_fmt_tf(rec.get('fwd_tflops'))} TF/s)"
    if "fwd_bwd_s" in rec:
        text += f", fwd+bwd {rec['fwd_bwd_s']:.2f} s ({_fmt_tf(rec.get('fwd_bwd_tflops'))} TF/s)"
    if rec.get("fwd_bwd_peak_allocated_bytes") is not None:
        text += f", peak {_fmt_bytes(rec['fwd_bwd_peak_allocated_bytes'])}"
    text += (f"; standard attention: P alone {_fmt_bytes(std['P_saved_for_backward_bytes'])}, "
             f"peak ~{_fmt_bytes(std['peak_estimate_bytes'])}")
    text += f"; sampled rows vs f64 {'ok' if rec.get('sampled_rows', {}).get('ok') else 'FAILED'}"
    if "fwd_bwd_s" in rec.get("sdpa_flash", {}):
        text += f"; SDPA flash fwd+bwd {rec['sdpa_flash']['fwd_bwd_s']:.2f} s"
    if rec.get("partial"):
        text += " (fwd+bwd did not finish)"
    return text


def render(report: dict) -> str:
    env, stages = report["environment"], report["stages"]
    lines = [f"## tvmflash gpu_check: {env.get('gpu') or 'CPU'}, torch {env.get('torch')}, tvm {env.get('tvm')}, "
             f"commit {(env.get('git_commit') or '?')[:10]}, {report.get('elapsed_s', 0):.0f} s"]
    if "compile" in stages:
        lines.append(compile_summary(stages["compile"]))
    if stages.get("correctness") is not None:
        lines += render_correctness(stages["correctness"])
    if stages.get("speed") is not None:
        lines += render_speed(stages["speed"])
    summary = report.get("summary", {})
    for key in BAR_KEYS:
        if key in summary:
            s = summary[key]
            lines.append(f"bar {key[4:]}: fwd {s['fwd']:.2f}x, bwd {_ratio(s['bwd'])}, fwd+bwd {s['fwd+bwd']:.2f}x "
                         f"SDPA flash -> {'meets' if s['meets_0.5x'] else 'BELOW'} 0.5x")
    if stages.get("long") is not None:
        lines += [render_long(rec) for rec in stages["long"].get("cases", [])] or ["long: no result"]
    for name, data in stages.items():
        lines += [f"note ({name}): {note[:300]}" for note in data.get("notes", [])]
    lines += [f"stage {s['stage']} skipped: {s['why']}" for s in report.get("skipped_stages", [])]
    lines.append(f"details: {report['args'].get('out_dir')}/gpu_check.json")
    return "\n".join(lines)
