"""Plain-PyTorch attention used as the reference, and the tolerance rule."""

import math

import torch


def poison_allocator():
    # Fill freed cached CUDA blocks with NaN so an output element the kernels never write shows up.
    x = torch.full((64 * 2**20,), float("nan"), device="cuda")
    del x


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), device="cpu"):
    """(seqlen_q, seqlen_k) bool: True where query i may see key j (bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    centre = i + seqlen_k - seqlen_q
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= centre - left
    if right >= 0:
        ok &= j <= centre + right
    return ok


def alibi_bias(slopes, seqlen_q, seqlen_k, device="cpu"):
    """ALiBi as an additive bias: -slope * |i + seqlen_k - seqlen_q - j|, (batch or 1, heads, sq, sk)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    dist = (i + seqlen_k - seqlen_q - j).abs().double()
    slopes = slopes.double().reshape(-1 if slopes.dim() == 2 else 1, slopes.shape[-1])
    return -slopes[:, :, None, None] * dist


def masked_scores(q, k, causal=False, window_size=(-1, -1), softmax_scale=None, attn_mask=None, attn_bias=None,
                  alibi_slopes=None, softcap=0.0, upcast=True):
    """(batch, heads, seqlen_q, seqlen_k) scores as the softmax sees them: scaled, soft-capped, plus
    ALiBi and a float bias, -inf where causal / window_size / attn_mask / a bool attn_bias hide a key."""
    if upcast:
        q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bihd,bjhd->bhij", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, q.shape[1], k.shape[1], q.device).to(scores.dtype)
    if attn_bias is not None and attn_bias.dtype == torch.bool:
        attn_mask = attn_bias if attn_mask is None else attn_mask & attn_bias
    elif attn_bias is not None:
        scores = scores + (attn_bias.double() if upcast else attn_bias.to(scores.dtype))
    ok = visible_mask(q.shape[1], k.shape[1], causal, window_size, q.device)
    if attn_mask is not None:
        ok = ok & attn_mask.to(ok.device)
    return scores.masked_fill(~ok, float("-inf"))


def attention_ref(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None, dropout_p=0.0,
                  keep_mask=None, upcast=True, attn_mask=None, attn_bias=None, alibi_slopes=None, softcap=0.0):
    """Standard attention on (batch, seqlen, heads, dim) tensors; upcast=True computes in float64.

    keep_mask: (batch, heads, seqlen_q, seqlen_k) bool, the dropout pattern to apply.
    attn_mask: bool broadcastable to (batch, heads, seqlen_q, seqlen_k), True = may attend (on top
    of causal / window_size). attn_bias: float (added to the scores) or bool (as attn_mask).
    softcap > 0 caps the scaled scores to softcap * tanh(x / softcap) before ALiBi and the bias.
    Returns (out, probs) with probs the softmax before dropout; rows that see nothing give 0.
    """
    dtype = q.dtype
    scores = masked_scores(q, k, causal, window_size, softmax_scale, attn_mask, attn_bias, alibi_slopes, softcap,
                           upcast)
    if upcast:
        v = v.double()
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    probs = torch.softmax(scores.float() if not upcast and dtype != torch.float32 else scores, dim=-1)
    probs = probs.nan_to_num(0.0).to(scores.dtype)  # rows with nothing visible
    p_used = probs
    if keep_mask is not None:
        p_used = probs.masked_fill(~keep_mask, 0.0) / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", p_used, v)
    return out.to(dtype if not upcast else torch.float64), probs


def output_rounding_term(q, k, out, ref, dout, **kw):
    """A scalar whose gradients are the error FlashAttention's backward inherits from its output.

    The backward forms dS = P * (dP - D) with D = rowsum(dO * O) read from the output the forward
    wrote, rounded to the input dtype (flash-attn's too); the exact D is rowsum(P * dP). An error
    e_i in D_i moves dS_ij by -P_ij e_i, which is the gradient of e_i * logsumexp_j(s_ij): so the
    gradients of sum_i e_i * lse_i with respect to q, k and a bias are that inherited error. It is
    at the rounding level unless a row's probability sits on one key (one visible key, say), where
    the exact dS cancels to 0 and PyTorch's own backward keeps the cancellation.
    """
    scores = masked_scores(q, k, **kw)
    dead = torch.isneginf(scores).all(-1, keepdim=True)  # rows that see nothing: out 0 both ways
    lse = scores.masked_fill(dead, 0.0).logsumexp(-1)  # (batch, heads, seqlen_q)
    e = (dout.double() * (out.double() - ref.double())).sum(-1).transpose(1, 2)
    return (e.detach() * lse).sum()


# "Small epsilon" of the tolerance rule, relative to the reference's magnitude: for 16-bit types
# one unit in the last place at that magnitude, since a result rounded to the output dtype can sit
# one step from the rounded reference even when PyTorch's happens to match it exactly (tiny cases).
EPS = {torch.float32: 2e-5, torch.float16: 2.0**-10, torch.float64: 1e-12, torch.bfloat16: 2.0**-7}


def check_rule(name, ours, ref, same_precision, dtype, inherited=0.0):
    """flash-attn's rule: our error against the float64 reference must be at most twice the error
    of plain PyTorch attention computed in the same low precision, plus a small epsilon.
    inherited: for a gradient, the largest error the backward takes over from the rounded output
    (the gradients of output_rounding_term), which PyTorch's backward does not have."""
    ours, ref, same_precision = ours.double(), ref.double(), same_precision.double()
    assert torch.isfinite(ours).all(), f"{name}: NaN/Inf in our result"
    err = (ours - ref).abs().max().item()
    pt_err = (same_precision - ref).abs().max().item()
    eps = EPS[dtype] * max(1.0, ref.abs().max().item())
    assert err <= 2 * pt_err + eps + inherited, \
        f"{name}: max error {err:.3g} > 2 x {pt_err:.3g} (PyTorch, {dtype}) + {eps:.3g} + {inherited:.3g} (inherited)"


def check_grads_against_reference(q, k, v, out, dout, grads, dtype, **kw):
    """Output and dq, dk, dv against the float64 reference and PyTorch in the same precision."""
    ref, ref_probs = attention_ref(q, k, v, **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
    check_rule("out", out, ref, pt, dtype)
    for name, g, rg, pg in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        check_rule(name, g, rg, pg, dtype)
    return ref_probs


def lse_ref(q, k, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None, alibi_slopes=None):
    """The rows' logsumexp of the scores attention_ref uses, float64 ((batch, heads, seqlen_q))."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bihd,bjhd->bhij", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, q.shape[1], k.shape[1], q.device).double()
    visible = visible_mask(q.shape[1], k.shape[1], causal, window_size, q.device)
    return scores.masked_fill(~visible, float("-inf")).logsumexp(-1)


def page_table(b, n, pages, device):
    """A block table of n pages for each of b entries, drawn in shuffled order from `pages`
    (the rest unused), as a column slice of a wider table (a row stride past its width)."""
    order = torch.randperm(pages, device=device)
    wide = torch.full((b, n + 2), -1, dtype=torch.int32, device=device)
    wide[:, :n] = order[:b * n].view(b, n).to(torch.int32)
    return wide[:, :n]


def to_pages(cache, table, pages):
    """A (b, rows, hk, d) cache as `pages` pages of rows / n rows where table says, NaN elsewhere."""
    b, n = table.shape
    out = torch.full((pages, cache.shape[1] // n) + cache.shape[2:], float("nan"), dtype=cache.dtype,
                     device=cache.device)
    out[table.long()] = cache.view(b, n, -1, *cache.shape[2:])
    return out


def from_pages(pages, table):
    """The paged cache read back entry by entry: (b, rows, hk, d)."""
    return pages[table.long()].flatten(1, 2)


def graph_counting_backend():
    """A torch.compile backend that runs each graph as traced, and the list it appends them to
    (one per compilation, so its length counts recompiles)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend, graphs
