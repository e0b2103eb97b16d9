"""BERT masked-language-model training on variable-length padded batches, once with PyTorch's
nn.MultiheadAttention and once with our kernels swapped in by flash_attn.replace_attention; the
padding goes through key_padding_mask (our attention takes it as a broadcast bias, no N x N
mask). Same seed, same batches, dropout off: the loss curves should agree; the script prints
both with tokens/s (real tokens, padding excluded) and peak memory.

Batches hold sequences of random lengths between --min-len and --seqlen, cut from the Python
standard library's source (bytes; token 256 is [MASK], 257 [PAD]); 15% of the real tokens are
masked (80% [MASK], 10% random, 10% kept), BERT's recipe.

    python examples/bert/train.py                 # GPU: BERT-base-sized, seqlen 512; CPU: tiny, seqlen 128
"""

import argparse
import os
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from common.compare import add_run_args, dispatch, start_run, train  # noqa: E402

MASK, PAD, VOCAB = 256, 257, 258
PRESETS = {"tiny": (2, 4, 128), "small": (6, 8, 384), "base": (12, 12, 768)}  # n_layer, n_head, n_embd


class BertMLM(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, seqlen):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, n_embd), nn.Embedding(seqlen, n_embd)
        self.ln = nn.LayerNorm(n_embd)
        layer = nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout=0.0, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(n_embd, n_embd), nn.GELU(), nn.LayerNorm(n_embd), nn.Linear(n_embd, VOCAB))

    def forward(self, ids, padding):
        x = self.ln(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))
        return self.head(self.encoder(x, src_key_padding_mask=padding))


def make_batch(data, args, gen):
    """(ids with masks applied, labels (-100 where not predicted), padding mask (True = pad)) and
    the number of real tokens."""
    lengths = torch.randint(args.min_len, args.seqlen + 1, (args.batch,), generator=gen)
    ids = torch.full((args.batch, args.seqlen), PAD, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        start = int(torch.randint(0, data.numel() - n, (1,), generator=gen))
        ids[i, :n] = data[start:start + n]
    padding = ids == PAD
    chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & ~padding
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    action = torch.rand(ids.shape, generator=gen)
    ids = torch.where(chosen & (action < 0.8), torch.full_like(ids, MASK), ids)
    ids = torch.where(chosen & (action >= 0.8) & (action < 0.9), torch.randint(0, 256, ids.shape, generator=gen), ids)
    return (ids, labels, padding), int(lengths.sum())


def run(args, attention: str) -> dict:
    model, data, gen, device = start_run(args.seed, attention, lambda: BertMLM(*PRESETS[args.preset], args.seqlen),
                                         args.deterministic)

    def next_batch():
        tensors, tokens = make_batch(data, args, gen)
        return tuple(t.to(device) for t in tensors), tokens

    def loss_of(model, batch):
        ids, labels, padding = batch
        logits = model(ids, padding)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)

    return train(model, next_batch, loss_of, args.steps, args.lr, attention, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--preset", choices=list(PRESETS), default="base" if gpu else "tiny")
    ap.add_argument("--steps", type=int, default=100 if gpu else 40)
    ap.add_argument("--seqlen", type=int, default=512 if gpu else 128)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32 if gpu else 8)
    add_run_args(ap, "bert", lr=3e-4)
    args = ap.parse_args()
    device = "cuda" if gpu else "cpu"
    dispatch(args, os.path.abspath(__file__), run, ("preset", "steps", "seqlen", "min_len", "batch", "lr", "seed"),
             f"bert_{args.preset}_{device}",
             f"BERT MLM {args.preset} on {device}, lengths {args.min_len}-{args.seqlen}, batch {args.batch}, "
             f"{args.steps} steps")


if __name__ == "__main__":
    main()
