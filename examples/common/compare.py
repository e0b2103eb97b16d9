"""Run one training function once per attention (PyTorch's, then ours) in child processes, so each
run's peak memory is its own, and report and plot the runs."""

import argparse
import glob
import json
import os
import resource
import subprocess
import sys
import sysconfig
import time
from typing import Callable, Tuple

import torch

from flash_attn import replace_attention


def corpus(max_files: int = 2000) -> torch.Tensor:
    """Text that ships with Python: its standard library's source, as one byte tensor."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    data = b"".join(open(f, "rb").read() for f in files[:max_files])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def progress(step: int, total: int, text: str) -> None:
    width, done = 30, int(30 * (step + 1) / total)
    sys.stderr.write(f"\r  [{'#' * done}{'.' * (width - done)}] {step + 1}/{total} {text}")
    if step + 1 == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def peak_memory_mb(device: str) -> tuple:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "CUDA allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process RSS"


def train(model: torch.nn.Module, next_batch: Callable[[], Tuple[object, int]],
          loss_of: Callable[[torch.nn.Module, object], torch.Tensor], steps: int, lr: float, attention: str,
          device: str, accum: int = 1) -> dict:
    """AdamW with a linear warm-up and gradient clipping, bf16 autocast on the GPU. next_batch()
    gives (batch, tokens in it); loss_of(model, batch) the loss; each step accumulates the
    gradients of accum batches, and its loss is their mean. Returns the run's record: per-step
    losses, time per step and tokens/s without the first steps (warm-up), peak memory."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, steps // 5)))
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    losses, times, tokens = [], [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        batches = [next_batch() for _ in range(accum)]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for batch, _ in batches:
            with amp:
                micro = loss_of(model, batch) / accum
            micro.backward()
            loss = loss + micro.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss))  # synchronises
        times.append(time.perf_counter() - t0)
        tokens.append(sum(n for _, n in batches))
        progress(step, steps, f"{attention}: loss {losses[-1]:.3f}")
    skip = min(5, steps // 2)
    peak, kind = peak_memory_mb(device)
    return dict(attention=attention, device=device, losses=losses, step_s=sum(times[skip:]) / len(times[skip:]),
                tokens_per_s=sum(tokens[skip:]) / sum(times[skip:]), peak_mb=peak, peak_kind=kind)


def start_run(seed: int, attention: str, build_model: Callable[[], torch.nn.Module], deterministic: bool = False):
    """A child's set-up: (model with our attention swapped in when attention == "ours", corpus,
    batch generator, device), seeded so that both runs build the same weights and batches.
    deterministic: every kernel that would add in no fixed order takes its reproducible variant
    (cuBLAS needs a fixed workspace for that), so two runs of one attention give the same losses
    and the runs of two attentions differ by the attention's rounding alone."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    data = corpus()
    model = build_model().to(device)
    if attention == "ours":
        replace_attention(model)
    return model, data, torch.Generator().manual_seed(seed), device


# The runs every example makes: PyTorch's attention (the loss reference), then ours.
RUNS = ("torch", "ours")


def add_run_args(ap, example: str, lr: float, runs: tuple = RUNS) -> None:
    """The options every example takes: learning rate, seed, output folder, and the hidden --run."""
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  example, "results"))
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True) in every run: no run-to-run drift of the reference")
    ap.add_argument("--run", choices=list(runs), help=argparse.SUPPRESS)


def dispatch(args, script: str, run: Callable, keys: tuple, stem: str, title: str, runs: tuple = RUNS) -> None:
    """In a child (--run given): run(args, attention) and print its record. In the parent: one
    child per entry of runs with the options named by keys, then the report (run_all)."""
    if args.run:
        print(json.dumps(run(args, args.run)))
        return
    option = lambda k: f"--{k.replace('_', '-')}"  # noqa: E731
    child = [f"{option(k)}={getattr(args, k)}" for k in keys] + [option("deterministic")] * args.deterministic
    run_all(script, child, args.out, stem, title, runs)


def run_all(script: str, child_args: list, out_dir: str, stem: str, title: str, runs: tuple = RUNS) -> list:
    """script --run <attention> with child_args for each of runs (the first is the loss reference,
    the last is ours), each printing its summary as JSON; prints the comparison and writes
    out_dir/stem.{json,png}."""
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for attention in runs:
        cmd = [sys.executable, script, "--run", attention] + child_args
        results.append(json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout))
    ref, ours = results[0], results[-1]
    # Largest per-step loss difference of each run against the reference: ours, and (with three
    # runs) PyTorch's other path, which shows how far rounding alone moves the curve.
    diffs = {r["attention"]: max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) for r in results[1:]}
    speedup = {r["attention"]: r["step_s"] / ours["step_s"] for r in results[:-1]}
    print(title)
    for r in results:
        print(f"  {r['attention']:10s}: final loss {r['losses'][-1]:.4f}, {r['step_s'] * 1e3:.1f} ms/step, "
              f"{r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_mb']:,.0f} MB ({r['peak_kind']})")
    print(f"  largest per-step loss difference against {ref['attention']}: "
          + ", ".join(f"{k} {100 * v:.3f}%" for k, v in diffs.items()))
    print("  speed-up of ours: " + ", ".join(f"{v:.2f}x over {k}" for k, v in speedup.items()))
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(dict(args=child_args, results=results, max_rel_loss_diff=diffs[ours["attention"]],
                       max_rel_loss_diffs=diffs, speedup=speedup), f)
    plot(results, os.path.join(out_dir, stem + ".png"), title)
    print(f"  plot: {os.path.join(out_dir, stem + '.png')}")
    return results


def plot(results: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for r, style in zip(results, ("-", "-.", "--", ":") if len(results) > 3 else ("-", "--", ":")):
        ax.plot(r["losses"], style, label=f"{r['attention']}: {r['tokens_per_s']:,.0f} tok/s, peak {r['peak_mb']:,.0f} MB")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
