"""Greedy decoding with a KV cache: a small GPT built from flash_attn.modules.MHA (rotary
embeddings, GQA) generates tokens once through the layers' caches (inference_params, one token a
step after the prompt) and once by running the whole prefix again at every step. Both compute the
same function, so they pick the same tokens (on the GPU in bf16 a near-tie may pick otherwise:
the script reports the agreement and the largest difference of the first step's logits), and the
cached run does a step's work on one token instead of the whole prefix.

CPU: the tiny preset in float32; GPU: --preset small in bf16. Writes a JSON record with --out.
"""

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flash_attn.modules import MHA  # noqa: E402
from flash_attn.utils.generation import InferenceParams  # noqa: E402

PRESETS = {"tiny": dict(layers=2, dim=128, heads=4, kv_heads=2, vocab=256),
           "small": dict(layers=12, dim=768, heads=12, kv_heads=4, vocab=32000)}


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, layer_idx):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = MHA(dim, heads, num_heads_kv=kv_heads, causal=True, rotary_emb_dim=dim // heads,
                        layer_idx=layer_idx)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, inference_params=None):
        x = x + self.attn(self.ln1(x), inference_params=inference_params)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, layers, dim, heads, kv_heads, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, i) for i in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, inference_params=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, inference_params)
        return self.head(self.ln_f(x))


@torch.no_grad()
def generate_cached(model, prompt, steps):
    ip = InferenceParams(max_seqlen=prompt.shape[1] + steps, max_batch_size=prompt.shape[0])
    logits = model(prompt, inference_params=ip)[:, -1]  # the prompt fills the caches
    first, tokens = logits, []
    ip.seqlen_offset = prompt.shape[1]
    for i in range(steps):
        tokens.append(logits.argmax(-1))
        if i + 1 < steps:  # one token a step through the caches
            logits = model(tokens[-1][:, None], inference_params=ip)[:, -1]
            ip.seqlen_offset += 1
    return torch.stack(tokens, 1), first


@torch.no_grad()
def generate_recomputed(model, prompt, steps):
    ids, first = prompt, None
    for _ in range(steps):
        logits = model(ids)[:, -1]
        first = logits if first is None else first
        ids = torch.cat([ids, logits.argmax(-1)[:, None]], dim=1)
    return ids[:, prompt.shape[1]:], first


def timed(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", choices=list(PRESETS), default=None, help="default: small on a GPU, tiny on the CPU")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 512 on a GPU, 128 on the CPU")
    ap.add_argument("--steps", type=int, default=None, help="default: 256 on a GPU, 32 on the CPU")
    ap.add_argument("--out", default=None, help="a directory for the JSON record")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    preset = a.preset or ("small" if gpu else "tiny")
    prompt_len, steps = a.prompt_len or (512 if gpu else 128), a.steps or (256 if gpu else 32)
    torch.manual_seed(0)
    cfg = PRESETS[preset]
    model = TinyGPT(**cfg).to(device=device, dtype=torch.bfloat16 if gpu else torch.float32).eval()
    prompt = torch.randint(0, cfg["vocab"], (a.batch, prompt_len), device=device)
    generate_cached(model, prompt[:, :8], 2)  # warm-up (allocations, kernels)
    (cached, first_c), t_cached = timed(lambda: generate_cached(model, prompt, steps), device)
    (recomputed, first_r), t_recomputed = timed(lambda: generate_recomputed(model, prompt, steps), device)
    record = dict(device=torch.cuda.get_device_name() if gpu else "cpu", preset=preset, batch=a.batch,
                  prompt_len=prompt_len, steps=steps,
                  cached_tokens_per_s=a.batch * steps / t_cached,
                  recomputed_tokens_per_s=a.batch * steps / t_recomputed,
                  token_agreement=(cached == recomputed).float().mean().item(),
                  first_step_max_logit_diff=(first_c.float() - first_r.float()).abs().max().item())
    print(f"{preset} on {record['device']}: batch {a.batch}, prompt {prompt_len}, {steps} new tokens")
    print(f"  cached     {record['cached_tokens_per_s']:10.1f} tokens/s")
    print(f"  recomputed {record['recomputed_tokens_per_s']:10.1f} tokens/s")
    print(f"  same token at {100 * record['token_agreement']:.1f}% of the steps; first step's logits differ by at "
          f"most {record['first_step_max_logit_diff']:.2e}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"decode_{preset}_{device}.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
