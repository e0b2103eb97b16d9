"""GPU benchmark of the score-modifier paths (issue 5): ours with a float attn_bias against SDPA's
EFFICIENT_ATTENTION with the same float attn_mask, side by side in one run, plus ours with ALiBi
and with softcap, and ours and FLASH_ATTENTION without any modifier for reference.
batch * seqlen = 16384 tokens, nheads * headdim = 2048, bf16. TFLOP/s as in benchmark_attention
(fwd = 4 b h s^2 d, halved for causal; bwd = 2.5x fwd). Bias kinds: "full" (batch, h, s, s),
"per_head" (1, h, s, s), "key_padding" (batch, 1, 1, s); with --bias-grad the bias requires grad
(its gradient is part of the backward). The target: ours >= 1.5x EFFICIENT_ATTENTION with the
same bias, forward and backward. Writes JSON (--out) and a PNG (--plot).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.benchmark_attention import finish_axis, save_results, time_fwd_bwd  # noqa: E402
from flash_attn import flash_attn_func  # noqa: E402

BIAS_SHAPES = {"full": lambda b, h, s: (b, h, s, s), "per_head": lambda b, h, s: (1, h, s, s),
               "key_padding": lambda b, h, s: (b, 1, 1, s)}


def make_case(impl, b, s, h, d, bias_kind, bias_grad, causal):
    """(fn, inputs that receive gradients) for one implementation."""
    bias = None
    if bias_kind is not None:
        bias = torch.randn(BIAS_SHAPES[bias_kind](b, h, s), device="cuda", dtype=torch.bfloat16)
        bias.requires_grad_(bias_grad)
    extra = [bias] if bias is not None and bias_grad else []
    if impl.startswith("ours"):
        q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        kw = dict(attn_bias=bias)
        if impl == "ours_alibi":
            kw = dict(alibi_slopes=torch.rand(h, device="cuda") * 0.1)
        elif impl == "ours_softcap":
            kw = dict(softcap=30.0)
        return (lambda: flash_attn_func(q, k, v, causal=causal, **kw)), [q, k, v] + extra
    q, k, v = [torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    backend = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[impl]
    mask = bias
    if bias is not None and causal:  # SDPA takes no is_causal with a mask: causal is folded into it, once
        tri = torch.ones(s, s, device="cuda", dtype=torch.bool).tril()
        mask = bias.detach().masked_fill(~tri, float("-inf")).requires_grad_(bias_grad)
        extra = [mask] if bias_grad else []

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    return fn, [q, k, v] + extra


def run_point(impl, b, s, h, d, bias_kind, bias_grad, causal):
    fn, inputs = make_case(impl, b, s, h, d, bias_kind, bias_grad, causal)
    t_fwd, t_fb, peak = time_fwd_bwd(fn, inputs)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    return dict(impl=impl, bias=bias_kind, bias_grad=bias_grad, causal=causal, seqlen=s, batch=b, nheads=h,
                headdim=d, fwd_ms=t_fwd, bwd_ms=t_fb - t_fwd, peak_mb=peak / 2**20,
                fwd_tflops=flops / t_fwd / 1e9, bwd_tflops=2.5 * flops / (t_fb - t_fwd) / 1e9)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["headdim"], r["causal"], r["bias"] or "none", r["bias_grad"]) for r in rows if r["bias"]})
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.2 * len(keys)), squeeze=False)
    for row_axes, key in zip(axes, keys):
        for ax, metric in zip(row_axes, ("fwd_tflops", "bwd_tflops")):
            for impl in ("ours", "efficient"):
                pts = sorted((r["seqlen"], r[metric]) for r in rows if r["impl"] == impl and
                             (r["headdim"], r["causal"], r["bias"] or "none", r["bias_grad"]) == key)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            finish_axis(ax, f"d={key[0]} {'causal' if key[1] else 'non-causal'} bias {key[2]}"
                        f"{' (grad)' if key[3] else ''}: {metric.split('_')[0]}", "seqlen", "TFLOP/s")
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--biases", default="full,per_head,key_padding")
    ap.add_argument("--bias-grad", action="store_true", help="also time each bias with requires_grad")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bias.json"))
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'impl':>13} {'bias':>11} {'grad':>4} {'c':>1} {'d':>3} {'seqlen':>6} {'fwd TF':>7} {'bwd TF':>7} "
          f"{'peak MB':>8} {'fwd x eff':>9} {'bwd x eff':>9}")
    for d in map(int, args.headdims.split(",")):
        h = 2048 // d
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for s in map(int, args.seqlens.split(",")):
                b = max(1, 16384 // s)
                cases = [("fa2", None, False), ("ours", None, False), ("ours_alibi", None, False),
                         ("ours_softcap", None, False)]
                for kind in args.biases.split(","):
                    for grad in ([False, True] if args.bias_grad else [False]):
                        cases += [("efficient", kind, grad), ("ours", kind, grad)]
                eff = {}
                for impl, kind, grad in cases:
                    try:
                        row = run_point(impl, b, s, h, d, kind, grad, causal)
                    except (RuntimeError, torch.OutOfMemoryError) as e:
                        print(f"{impl} {kind} {grad}: {str(e).splitlines()[0]}")
                        torch.cuda.empty_cache()
                        continue
                    if impl == "efficient":
                        eff[(kind, grad)] = row
                    base = eff.get((kind, grad)) if impl == "ours" else None
                    row["fwd_vs_efficient"] = base and row["fwd_tflops"] / base["fwd_tflops"]
                    row["bwd_vs_efficient"] = base and row["bwd_tflops"] / base["bwd_tflops"]
                    rows.append(row)
                    ratio = (f"{row['fwd_vs_efficient']:>9.2f} {row['bwd_vs_efficient']:>9.2f}" if base else "")
                    print(f"{impl:>13} {str(kind):>11} {int(grad):>4} {int(causal):>1} {d:>3} {s:>6} "
                          f"{row['fwd_tflops']:>7.0f} {row['bwd_tflops']:>7.0f} {row['peak_mb']:>8.0f} {ratio}",
                          flush=True)
                    torch.cuda.empty_cache()
    save_results(rows, args.out, plot, args.plot, dtype="bf16")


if __name__ == "__main__":
    main()
