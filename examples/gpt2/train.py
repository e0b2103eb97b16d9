"""GPT-2 built from nn.MultiheadAttention blocks, trained three times from the same seed:
- sdpa: the blocks call the layer with need_weights=False and is_causal=True, so PyTorch runs its
  fused SDPA kernel (PyTorch's choice, or --sdpa-backend's); the loss reference;
- default: the blocks call the layer with its defaults (need_weights=True), as most code written
  for nn.MultiheadAttention does, so PyTorch materialises the attention weights;
- ours: the sdpa run's model after flash_attn.replace_attention;
- sdpa_again (with --repeat-reference): the sdpa run once more, which shows how far the curve
  moves from one run to the next (kernels that add with atomics sum in no fixed order).
Dropout is off, so the runs compute the same function and their loss curves should lie on top of
each other; the script prints and plots them, with tokens/s and peak memory of each.

The corpus ships with Python: the source of its standard library, as bytes (a 256-token
vocabulary; the 124M preset keeps GPT-2's 50304-row embedding, of which those 256 rows are used).

    python examples/gpt2/train.py                      # a size that fits the machine: tiny on a CPU
    python examples/gpt2/train.py --preset 124M --steps 200 --seqlen 1024 --batch 16   # the GPU check

Each run is a subprocess of this script (--run sdpa|default|ours), so the peak memory is its own.
"""

import argparse
import contextlib
import math
import os
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from common.compare import add_run_args, dispatch, start_run, train  # noqa: E402

PRESETS = {  # n_layer, n_head, n_embd, vocab
    "tiny": (2, 4, 128, 256),
    "small": (6, 8, 384, 256),
    "124M": (12, 12, 768, 50304),
}


RUNS = ("sdpa", "default", "ours")  # see the docstring
REPEAT = "sdpa_again"  # the reference, run twice (--repeat-reference)
SDPA_BACKENDS = {"flash": lambda b: b.FLASH_ATTENTION, "cudnn": lambda b: b.CUDNN_ATTENTION,
                 "efficient": lambda b: b.EFFICIENT_ATTENTION, "math": lambda b: b.MATH}


class Block(nn.Module):
    def __init__(self, dim, heads, default_call):
        super().__init__()
        self.default_call = default_call
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.0, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x, causal_mask):
        h = self.ln1(x)
        if self.default_call:
            a = self.attn(h, h, h, attn_mask=causal_mask)[0]
        else:
            a = self.attn(h, h, h, attn_mask=causal_mask, is_causal=True, need_weights=False)[0]
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, vocab, seqlen, default_call=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(seqlen, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, default_call) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(seqlen), persistent=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02 / (math.sqrt(2 * n_layer) if name.endswith(("out_proj.weight", "mlp.2.weight")) else 1))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = self.causal_mask[:t, :t]
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def run(args, attention: str) -> dict:
    model, data, gen, device = start_run(
        args.seed, attention, lambda: GPT2(*PRESETS[args.preset], args.seqlen, attention == "default"), args.deterministic)

    def next_batch():
        starts = torch.randint(0, data.numel() - args.seqlen - 1, (args.batch,), generator=gen)
        return torch.stack([data[s:s + args.seqlen + 1] for s in starts.tolist()]).to(device), args.batch * args.seqlen

    def loss_of(model, chunk):
        logits = model(chunk[:, :-1])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())

    backend = contextlib.nullcontext()
    if attention in ("sdpa", REPEAT) and args.sdpa_backend != "auto":  # else PyTorch picks (cuDNN's on Hopper)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = sdpa_kernel(SDPA_BACKENDS[args.sdpa_backend](SDPBackend))
    with backend:
        return train(model, next_batch, loss_of, args.steps, args.lr, attention, device, args.accum)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--preset", choices=list(PRESETS), default="124M" if gpu else "tiny")
    ap.add_argument("--steps", type=int, default=200 if gpu else 60)
    ap.add_argument("--seqlen", type=int, default=1024 if gpu else 128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1, help="batches whose gradients make one step")
    ap.add_argument("--repeat-reference", action="store_true",
                    help="run the reference (sdpa) a second time, to show its own run-to-run drift")
    ap.add_argument("--sdpa-backend", choices=("auto",) + tuple(SDPA_BACKENDS), default="auto",
                    help="the SDPA kernel of the sdpa runs (auto: PyTorch's choice)")
    add_run_args(ap, "gpt2", lr=3e-4, runs=RUNS + (REPEAT,))
    args = ap.parse_args()
    runs = (RUNS[0], REPEAT) + RUNS[1:] if args.repeat_reference else RUNS
    device = "cuda" if gpu else "cpu"
    title = (f"GPT-2 {args.preset} on {device}, seqlen {args.seqlen}, batch {args.batch}"
             f"{f' x {args.accum} accumulated' if args.accum > 1 else ''}, {args.steps} steps"
             f"{', deterministic' if args.deterministic else ''}"
             f"{f', SDPA {args.sdpa_backend}' if args.sdpa_backend != 'auto' else ''}")
    keys = ("preset", "steps", "seqlen", "batch", "accum", "lr", "seed", "sdpa_backend")
    dispatch(args, os.path.abspath(__file__), run, keys,
             f"gpt2_{args.preset}_{device}{'_deterministic' if args.deterministic else ''}"
             f"{'' if args.sdpa_backend == 'auto' else '_' + args.sdpa_backend}", title, runs)


if __name__ == "__main__":
    main()
