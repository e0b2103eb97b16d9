"""A long-sequence model trained with block-sparse attention on a task that needs the whole sequence.

Task (generated on the fly): a sequence of random "noise" tokens hides one "needle" token, drawn
from a vocabulary the noise never uses, at a uniformly random position; a [CLS] token at position
0 must name the needle. The needle can be anywhere, so position 0 has to see every key.

Model: token embeddings, then layers of pre-norm block-sparse self-attention + MLP. The pattern is
Longformer-style global + local (flash_attn.block_sparse.global_local_layout): every query block
sees its neighbours and the first key block, and the first query block (holding [CLS]) sees every
key block, so the cost is linear in the length while [CLS] still reads the whole sequence.

Training follows a length curriculum: the sequence length doubles from 128 up to --seqlen in
equal phases, at a constant number of tokens per batch. Attention here is content-based, so what
is learnt at one length carries over to the next; starting long, the needle's share of [CLS]'s
initial, near-uniform attention (1 / length) would leave almost no gradient.

After training, it times one training step at the same length with (a) this block-sparse model,
(b) the same model on dense flash attention, (c) plain PyTorch attention (the N x N matrix), which
runs out of memory at long lengths. Writes a PNG of loss and accuracy per step (--plot).

  python examples/long_range_blocksparse.py                  # CPU: toy size, a few minutes
  python examples/long_range_blocksparse.py --seqlen 65536   # a GPU (the GPU default)
"""

import argparse
import math
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flash_attn import flash_attn_func  # noqa: E402
from flash_attn.modules import BlockSparseMultiheadAttention  # noqa: E402

NOISE, NEEDLES = 32, 16  # token ids: [0, NOISE) noise, [NOISE, NOISE + NEEDLES) needles, then [CLS]
CLS = NOISE + NEEDLES


def batch_of(batch, seqlen, device, gen):
    x = torch.randint(0, NOISE, (batch, seqlen), generator=gen)
    needle = torch.randint(0, NEEDLES, (batch,), generator=gen)
    where = torch.randint(1, seqlen, (batch,), generator=gen)
    x[torch.arange(batch), where] = NOISE + needle
    x[:, 0] = CLS
    return x.to(device), needle.to(device)


class Block(nn.Module):
    def __init__(self, dim, heads, attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = BlockSparseMultiheadAttention(dim, heads, pattern="global_local",
                                                  pattern_options=dict(window_blocks=1, global_blocks=1))
        self.attention = attention  # "sparse", "dense" (flash, every tile) or "torch" (N x N matrix)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attend(self, x):
        if self.attention == "sparse":
            return self.attn(x)
        b, s, dim = x.shape
        q, k, v = self.attn.Wqkv(x).view(b, s, 3, self.attn.num_heads, -1).unbind(2)
        if self.attention == "dense":
            out = flash_attn_func(q, k, v)
        else:
            scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])
            out = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)
        return self.attn.out_proj(out.reshape(b, s, dim))

    def forward(self, x):
        x = x + self.attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class NeedleModel(nn.Module):
    def __init__(self, dim, heads, layers, attention="sparse"):
        super().__init__()
        self.embed = nn.Embedding(CLS + 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, NEEDLES))

    def set_attention(self, attention):
        for blk in self.blocks:
            blk.attention = attention

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x[:, 0])  # [CLS]


def step_time(model, tokens, labels, device, repeat=3):
    """Seconds per training step (forward, backward), or the error that stopped it."""
    try:
        times = []
        for _ in range(repeat + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            nn.functional.cross_entropy(model(tokens), labels).backward()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        return sorted(times[1:])[len(times[1:]) // 2]
    except (torch.OutOfMemoryError, RuntimeError) as e:
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        return "out of memory" if "out of memory" in str(e).lower() else str(e).splitlines()[0][:80]


def main():
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=65536 if gpu else 1024)
    ap.add_argument("--tokens", type=int, default=4 * 65536 if gpu else 8192, help="tokens per batch")
    ap.add_argument("--dim", type=int, default=256 if gpu else 64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps-per-length", type=int, default=100 if gpu else 40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="long_range_blocksparse.png")
    args = ap.parse_args()
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    model = NeedleModel(args.dim, args.heads, args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    mask = model.blocks[0].attn.mask_for(args.seqlen, device)
    lengths = [min(args.seqlen, 128 * 2**i) for i in range(max(1, math.ceil(math.log2(args.seqlen / 128)) + 1))]
    steps = args.steps_per_length * len(lengths)
    print(f"{device}: lengths {lengths[0]}..{args.seqlen} ({args.steps_per_length} steps each), {args.tokens} tokens "
          f"per batch, {args.layers} layers, dim {args.dim}; block density at {args.seqlen}: {mask.density:.4f} "
          f"({mask.layout.sum().item()} of {mask.layout.numel()} tiles)")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.05)
    losses, accs = [], []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        length = lengths[(step - 1) // args.steps_per_length]
        tokens, labels = batch_of(max(1, args.tokens // length), length, device, gen)
        with torch.autocast(device, dtype=dtype, enabled=gpu):
            logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        accs.append((logits.argmax(-1) == labels).float().mean().item())
        if step % args.steps_per_length == 0:
            recent = accs[-args.steps_per_length // 2:]
            print(f"step {step:4d}  length {length:6d}  loss {loss.item():.3f}  accuracy over the last "
                  f"{len(recent)} steps {sum(recent) / len(recent):.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"chance is {1 / NEEDLES:.2f}")

    tokens, labels = batch_of(max(1, args.tokens // args.seqlen), args.seqlen, device, gen)
    print("one training step at this length:")
    for attention in ("sparse", "dense", "torch"):
        model.set_attention(attention)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast(device, dtype=dtype, enabled=gpu):
            t = step_time(model, tokens, labels, device)
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device == "cuda" else ""
        label = {"sparse": "block-sparse flash", "dense": "dense flash", "torch": "plain attention (N x N)"}
        print(f"  {label[attention]:>24}: " + (f"{t * 1e3:8.1f} ms{peak}" if isinstance(t, float) else t))

    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
        a.plot(losses)
        for i in range(1, len(lengths)):
            a.axvline(i * args.steps_per_length, color="gray", linewidth=0.5)
        a.set(title=f"loss (length doubles at each grey line, up to {args.seqlen})", xlabel="step")
        b.plot(accs, alpha=0.4)
        b.axhline(1 / NEEDLES, color="k", linestyle="--", linewidth=1, label="chance")
        b.set(title="accuracy", xlabel="step")
        b.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=80)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
