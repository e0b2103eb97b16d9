"""GPU benchmark: our kernels against PyTorch SDPA's backends (FLASH_ATTENTION = FlashAttention-2,
CUDNN_ATTENTION, EFFICIENT_ATTENTION, MATH where it fits) and FlexAttention (impl "flex":
torch.compile'd flex_attention, causal as a BlockMask), side by side in one run.

Setup as in the flash-attn benchmarks: batch * seqlen = 16384 tokens, nheads * headdim = 2048.
FLOPs: fwd = 4 b h s^2 d (halved for causal), bwd = 2.5 x fwd. Times are medians of CUDA-event
timings after warm-up; bwd = (fwd+bwd) - fwd. Peak memory is what fwd+bwd allocates beyond the
inputs. Writes JSON (--out) and a PNG plot of TFLOP/s against seqlen (--plot).
Impl "ours_portable" is ours with FLASH_ATTN_DISABLE_SM90=1: the sm80-style kernels on a Hopper GPU;
"ours_sync" is ours with FLASH_ATTN_SM90_FWD_SYNC=1: the sm90 forward without warp specialization;
"ours_per_tile" is ours with FLASH_ATTN_SM90_FWD_PERSISTENT=0: the warp-specialized forward with a
CTA per tile instead of a persistent one; "ours_det" is ours with deterministic=True (the
backward's dQ added in a fixed order).
"""

import argparse
import json
import os
import sys
from statistics import median

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from flash_attn import flash_attn_func  # noqa: E402

SDPA = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ENV_IMPLS = {"ours_portable": {"FLASH_ATTN_DISABLE_SM90": "1"},
             "ours_sync": {"FLASH_ATTN_SM90_FWD_SYNC": "1"},
             "ours_per_tile": {"FLASH_ATTN_SM90_FWD_PERSISTENT": "0"}}


_flex = None


def compiled_flex():
    """torch.compile'd flex_attention, compiled once per process."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    from torch.nn.attention.flex_attention import flex_attention
    global _flex
    if _flex is None:
        # Donated buffers (the compiled backward freeing saved tensors as it goes) forbid the
        # retain_graph backward that interleaved_times times on its own.
        functorch_config.donated_buffer = False
        # A compile per shape, block mask function and grad mode: past Dynamo's limits (8 per
        # function) it would fall back to the unfused, scores-materializing implementation. Static
        # shapes: from a second shape on Dynamo would otherwise compile for dynamic ones, whose
        # kernels ran 1.3x slower on the H200 (NOTES, fifteenth session).
        torch._dynamo.config.recompile_limit = 1000
        torch._dynamo.config.accumulated_recompile_limit = 10000
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


def make_fn(impl, b, s, h, d, dtype, causal):
    if impl in ("ours", "ours_det", *ENV_IMPLS):
        q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]
        det = impl == "ours_det"
        return (lambda: flash_attn_func(q, k, v, causal=causal, deterministic=det)), (q, k, v)
    q, k, v = [torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)]
    if impl == "flex":  # no mask, or causal as a BlockMask (its tiles above the diagonal skipped)
        from torch.nn.attention.flex_attention import create_block_mask
        flex_attention = compiled_flex()
        block_mask = create_block_mask(lambda b_, h_, i, j: j <= i, None, None, s, s, device="cuda") if causal else None
        return (lambda: flex_attention(q, k, v, block_mask=block_mask)), (q, k, v)

    def fn():
        with sdpa_kernel(SDPA[impl]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn, (q, k, v)


# About a millisecond of GPU spinning queued before each timed call (torch.cuda._sleep counts SM
# clock cycles): the host reaches the call's kernel launches while the GPU is still busy, so the
# events time the GPU's work and not the Python and dispatcher time before the first launch, which
# is tens of microseconds (a fifth of a 0.3 ms windowed forward) and which a training step hides by
# running the host ahead of the GPU. A call that synchronizes, or whose host time exceeds the spin,
# is still timed with it.
_SPIN_CYCLES = 2_000_000


def median_ms(fn, reps, budget_ms=300.0, max_reps=200):
    """Median of at least reps CUDA-event timings of fn(), more for short fns (up to budget_ms of
    timed work or max_reps): sub-millisecond steps vary by ~10% from run to run otherwise."""
    def timed():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    for _ in range(3):
        fn()
    reps = max(reps, min(max_reps, int(budget_ms / max(timed(), 1e-3))))
    return sorted(timed() for _ in range(reps))[reps // 2]


def measure(impl, b, s, h, d, dtype, causal):
    if impl in ENV_IMPLS:
        os.environ.update(ENV_IMPLS[impl])
        try:
            return measure("ours", b, s, h, d, dtype, causal)
        finally:
            for var in ENV_IMPLS[impl]:
                del os.environ[var]
    return time_fwd_bwd(*make_fn(impl, b, s, h, d, dtype, causal))


def _fwd_bwd_step(fwd, inputs, dout):
    def fwd_bwd():
        for t in inputs:
            t.grad = None
        fwd().backward(dout)
    return fwd_bwd


def peak_fwd_bwd_bytes(fwd, inputs):
    """Peak memory of one forward+backward of fwd() beyond what was allocated before it."""
    fwd_bwd = _fwd_bwd_step(fwd, inputs, torch.randn_like(fwd()))
    fwd_bwd()
    for t in inputs:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in inputs:
        t.grad = None
    return peak


def time_fwd_bwd(fwd, inputs):
    """Median forward and forward+backward ms of fwd() (gradients into inputs), and the peak memory
    of one forward+backward beyond what was allocated before it."""
    fwd_bwd = _fwd_bwd_step(fwd, inputs, torch.randn_like(fwd()))
    with torch.no_grad():
        t_fwd = median_ms(fwd, 20)
    t_fb = median_ms(fwd_bwd, 10)
    return t_fwd, t_fb, peak_fwd_bwd_bytes(fwd, inputs)


def interleaved_times(points, rounds=5, budget_ms=100.0):
    """Forward and backward ms of every point in points ({name: (fwd, inputs)}), timed round-robin:
    each round takes one median of every point's forward (no grad) and of its backward alone
    (autograd.grad of one kept forward output with retain_graph, as flash-attn's benchmarks time
    it, rather than (fwd+bwd) - fwd, the difference of two noisy numbers). The H200's clocks drift
    over a run (the same 10 ms backward timed 6.5% apart a minute later), and a round's points
    drift together, so ratios taken within a round, then their median over the rounds, are steadier
    than ratios of points timed minutes apart. Returns {name: {"fwd": [ms], "bwd": [ms]}}."""
    timers = {}
    for name, (fwd, inputs) in points.items():
        out = fwd()
        dout = torch.randn_like(out)

        def fwd_only(fwd=fwd):
            with torch.no_grad():
                fwd()
        timers[name] = (fwd_only, lambda out=out, dout=dout, inputs=inputs:
                        torch.autograd.grad(out, inputs, dout, retain_graph=True))
    times = {name: {"fwd": [], "bwd": []} for name in points}
    for _ in range(rounds):
        for name, (fwd_only, bwd_only) in timers.items():
            times[name]["fwd"].append(median_ms(fwd_only, 5, budget_ms))
            times[name]["bwd"].append(median_ms(bwd_only, 5, budget_ms))
    return times


def median_ratio(num, den, scale=1.0):
    """Median over rounds of num[r] / (scale * den[r]): two points' times within each round."""
    return median([a / (scale * b) for a, b in zip(num, den)])


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["dtype"], r["headdim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.2 * len(keys)), squeeze=False)
    for row_axes, key in zip(axes, keys):
        for ax, metric in zip(row_axes, ("fwd_tflops", "bwd_tflops")):
            for impl in sorted({r["impl"] for r in rows}):
                pts = sorted((r["seqlen"], r[metric]) for r in rows if (r["dtype"], r["headdim"], r["causal"]) == key
                             and r["impl"] == impl and r[metric] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl, linewidth=2.5 if impl == "ours" else 1.2)
            ax.set_xscale("log", base=2)
            finish_axis(ax, f"{key[0]} d={key[1]} {'causal' if key[2] else 'non-causal'}: {metric.split('_')[0]}",
                        "seqlen", "TFLOP/s")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def save_results(rows, out, plot, plot_path=None, **meta):
    """rows as JSON at out (with the GPU, torch and meta) and plot(rows, path) as a PNG beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, **meta)
    with open(out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, plot_path or os.path.splitext(out)[0] + ".png")


def finish_axis(ax, title, xlabel, ylabel):
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--impls", default="ours,fa2,cudnn,efficient,math,flex")
    ap.add_argument("--math-max-seqlen", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu.json"))
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    rows = []
    for dt in args.dtypes.split(","):
        for d in map(int, args.hdims.split(",")):
            for causal in (c == "1" for c in args.causal.split(",")):
                for s in map(int, args.seqlens.split(",")):
                    b, h = max(1, 16384 // s), 2048 // d
                    flops = 4 * b * h * s * s * d / (2 if causal else 1)
                    for impl in args.impls.split(","):
                        row = dict(impl=impl, dtype=dt, headdim=d, causal=causal, seqlen=s, batch=b, nheads=h)
                        if impl == "math" and s > args.math_max_seqlen:
                            continue
                        try:
                            t_fwd, t_fb, peak = measure(impl, b, s, h, d, DTYPES[dt], causal)
                            row.update(fwd_ms=t_fwd, bwd_ms=t_fb - t_fwd, peak_mb=peak / 2**20,
                                       fwd_tflops=flops / t_fwd / 1e9, bwd_tflops=2.5 * flops / (t_fb - t_fwd) / 1e9,
                                       fwdbwd_tflops=3.5 * flops / t_fb / 1e9)
                        except RuntimeError as e:  # a backend that does not take this shape
                            row.update(fwd_ms=None, bwd_ms=None, peak_mb=None, fwd_tflops=None, bwd_tflops=None,
                                       fwdbwd_tflops=None, error=str(e).splitlines()[0][:200])
                        rows.append(row)
                        torch.cuda.empty_cache()
    save_results(rows, args.out, plot, args.plot, cudnn=torch.backends.cudnn.version())

    impls = args.impls.split(",")
    print("fwd / bwd TFLOP/s; peak MB of fwd+bwd in brackets")
    by = {(r["impl"], r["dtype"], r["headdim"], r["causal"], r["seqlen"]): r for r in rows}
    for key in sorted({(r["dtype"], r["headdim"], r["causal"]) for r in rows}):
        print(f"\n{key[0]} d={key[1]} causal={key[2]}")
        print(f"{'seqlen':>6} " + " ".join(f"{i:>20}" for i in impls))
        for s in map(int, args.seqlens.split(",")):
            cells = []
            for impl in impls:
                r = by.get((impl,) + key + (s,))
                cells.append(f"{'-':>20}" if not r or r["fwd_tflops"] is None else
                             f"{r['fwd_tflops']:6.0f}/{r['bwd_tflops']:4.0f} [{r['peak_mb']:5.0f}]")
            print(f"{s:>6} " + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
