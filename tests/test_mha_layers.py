"""flash-attn-style layers: rotary embeddings against a complex-number reference, ALiBi slopes,
FlashSelfAttention / FlashCrossAttention against the functional API, and MHA (fused QKV, GQA,
rotary, cross-attention, causal, window, ALiBi, key padding, packed sequences) against a plain
float64 reference built from the same weights; CPU in float32, GPU in bf16 / fp16 under the
tolerance rule."""

import copy
import math

import pytest
import torch

from flash_attn import flash_attn_func
from flash_attn.layers import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_func, apply_rotary_emb_kv_,
                               apply_rotary_emb_qkv_)
from flash_attn.modules import MHA, FlashCrossAttention, FlashSelfAttention
from flash_attn.modules.mha import get_alibi_slopes
from flash_attn.utils.generation import InferenceParams
from reference import attention_ref, check_rule


def rope_ref(x, rot, base=10000.0, interleaved=False, positions=None, xpos=None):
    """RoPE as complex multiplication, float64: x (..., seqlen, heads, d) with positions (seqlen,)
    or broadcastable to x's leading dims. xpos = (scale_base, centre, sign): XPos, pair i's rotor
    also scaled by zeta_i ** (sign * (position - centre) / scale_base) (sign 1 for q, -1 for k)."""
    seqlen = x.shape[-3]
    pos = torch.arange(seqlen, dtype=torch.float64, device=x.device) if positions is None else positions.double()
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64, device=x.device) / rot)
    mag = torch.ones_like(pos[..., None] * inv)
    if xpos is not None:
        scale_base, centre, sign = xpos
        zeta = (torch.arange(0, rot, 2, dtype=torch.float64, device=x.device) + 0.4 * rot) / (1.4 * rot)
        mag = zeta ** (sign * (pos[..., None] - centre) / scale_base)
    rotor = torch.polar(mag, pos[..., None] * inv).unsqueeze(-2)  # (..., 1, rot/2)
    xr = x[..., :rot].double()
    if interleaved:
        z = torch.view_as_complex(xr.unflatten(-1, (-1, 2)).contiguous())
        out = torch.view_as_real(z * rotor).flatten(-2)
    else:
        z = torch.complex(xr[..., : rot // 2], xr[..., rot // 2:])
        y = z * rotor
        out = torch.cat((y.real, y.imag), dim=-1)
    return torch.cat((out, x[..., rot:].double()), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [16, 32])
def test_rotary_matches_complex_reference(interleaved, rot):
    x = torch.randn(2, 13, 3, 32)
    cos, sin = RotaryEmbedding(rot).cos_sin(20, "cpu")
    torch.testing.assert_close(apply_rotary_emb(x, cos, sin, interleaved).double(), rope_ref(x, rot, interleaved=interleaved),
                               atol=1e-5, rtol=1e-5)
    # offsets: an int, per sequence, and packed sequences restarting at 0
    torch.testing.assert_close(apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=4).double(),
                               rope_ref(x, rot, interleaved=interleaved, positions=torch.arange(4, 17)), atol=1e-5, rtol=1e-5)
    offs = torch.tensor([0, 5])
    got = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offs).double()
    for b in range(2):
        torch.testing.assert_close(got[b], rope_ref(x[b:b + 1], rot, interleaved=interleaved,
                                                    positions=torch.arange(13) + offs[b])[0], atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 5, 13, 26], dtype=torch.int32)
    packed = x.reshape(26, 3, 32)
    got = apply_rotary_emb(packed, cos, sin, interleaved, cu_seqlens=cu, max_seqlen=13).double()
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(got[s:e], rope_ref(packed[None, s:e], rot, interleaved=interleaved)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_packed_in_place_helpers(interleaved):
    """apply_rotary_emb_qkv_ (3-way packed, and GQA-packed with num_heads_q, with separate k
    tables) and apply_rotary_emb_kv_ rotate q and k in place, v untouched."""
    cos, sin = RotaryEmbedding(16).cos_sin(20, "cpu")
    qkv = torch.randn(2, 13, 3, 4, 32)
    want = qkv.clone()
    want[:, :, :2] = apply_rotary_emb(want[:, :, :2].flatten(2, 3), cos, sin, interleaved,
                                      seqlen_offsets=3).unflatten(2, (2, 4))
    assert apply_rotary_emb_qkv_(qkv, cos, sin, interleaved=interleaved, seqlen_offsets=3) is qkv
    torch.testing.assert_close(qkv, want)
    gqa = torch.randn(2, 13, 4 + 2 * 2, 32)
    want = gqa.clone()
    want[:, :, :4] = apply_rotary_emb(want[:, :, :4], cos, sin, interleaved)
    want[:, :, 4:6] = apply_rotary_emb(want[:, :, 4:6], cos * 0.5, sin * 0.5, interleaved)
    apply_rotary_emb_qkv_(gqa, cos, sin, cos * 0.5, sin * 0.5, interleaved=interleaved, num_heads_q=4)
    torch.testing.assert_close(gqa, want)
    kv = torch.randn(2, 13, 2, 2, 32)
    want = kv.clone()
    want[:, :, 0] = apply_rotary_emb(want[:, :, 0], cos, sin, interleaved)
    torch.testing.assert_close(apply_rotary_emb_kv_(kv, cos, sin, interleaved), want)
    assert apply_rotary_emb_func is apply_rotary_emb
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(torch.randn(2, 13, 8, 32), cos, sin)
    with pytest.raises(ValueError, match="kv must be"):
        apply_rotary_emb_kv_(torch.randn(2, 13, 3, 2, 32), cos, sin)


def test_rotary_tables_stay_float32_after_half():
    rope = RotaryEmbedding(32).half()  # the inv_freq buffer becomes float16; the tables must not
    cos, _ = rope.cos_sin(4096, "cpu")
    angle = torch.arange(4096, dtype=torch.float64)[:, None] / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    torch.testing.assert_close(cos.double(), torch.cos(angle), atol=2e-3, rtol=0)


def test_rotary_module_takes_flash_attn_forms():
    """RotaryEmbedding.forward in flash-attn's argument order (qkv, kv, seqlen_offset, max_seqlen,
    num_heads_q): a GQA-packed qkv (num_heads_q + 2 * nheads_k heads) rotates as q with its kv,
    padded or packed; pos_idx_in_fp32=False computes the angles in the buffer's dtype."""
    rope = RotaryEmbedding(16, interleaved=True)
    q, kv = torch.randn(2, 13, 4, 32), torch.randn(2, 13, 2, 2, 32)
    want_q, want_kv = rope(q, kv, 3)
    got = rope(torch.cat((q, kv[:, :, 0], kv[:, :, 1]), dim=2), None, 3, None, 4)
    torch.testing.assert_close(got, torch.cat((want_q, want_kv[:, :, 0], want_kv[:, :, 1]), dim=2))
    cu = torch.tensor([0, 13, 26], dtype=torch.int32)
    packed = rope(torch.cat((q, kv[:, :, 0], kv[:, :, 1]), dim=2).flatten(0, 1), num_heads_q=4, cu_seqlens=cu,
                  max_seqlen=13)
    plain_q, plain_kv = rope(q, kv)
    torch.testing.assert_close(packed, torch.cat((plain_q, plain_kv.flatten(2, 3)), dim=2).flatten(0, 1))
    with pytest.raises(ValueError, match="num_heads_q"):
        rope(torch.randn(2, 13, 7, 32), num_heads_q=4)
    half = RotaryEmbedding(32, pos_idx_in_fp32=False).half()
    cos, _ = half.cos_sin(4096, "cpu")
    angle = torch.outer(torch.arange(4096, dtype=torch.float16), half.inv_freq).float()
    torch.testing.assert_close(cos, torch.cos(angle))
    assert (cos - RotaryEmbedding(32).half().cos_sin(4096, "cpu")[0]).abs().max() > 0.1  # (why the default is fp32)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_xpos_matches_reference(interleaved):
    """scale_base (XPos): q scaled by zeta ** ((m - c) / scale_base) and k by the inverse, c half
    the longest table so far (flash-attn's cached tables); a longer table moves c and the rotated
    q and k, but not their scores."""
    rope = RotaryEmbedding(16, interleaved=interleaved, scale_base=40)
    assert rope.scale is not None and RotaryEmbedding(16).scale is None
    qkv = torch.randn(2, 21, 3, 2, 32)
    out = rope(qkv, seqlen_offset=3)  # a table of 24 positions: c = 12
    pos = torch.arange(3, 24)
    for i, sign in ((0, 1), (1, -1)):
        want = rope_ref(qkv[:, :, i], 16, interleaved=interleaved, positions=pos, xpos=(40, 12, sign))
        torch.testing.assert_close(out[:, :, i].double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, :, 2], qkv[:, :, 2])
    rope(qkv[:, :5], max_seqlen=300)  # the table grows to 300 positions (c = 150) and stays
    later = rope(qkv, seqlen_offset=3)
    assert rope._seq_len_cached == 300 and not torch.allclose(later, out)
    scores = lambda t: torch.einsum("bmhd,bnhd->bhmn", t[:, :, 0].double(), t[:, :, 1].double())
    torch.testing.assert_close(scores(later), scores(out), atol=1e-4, rtol=1e-4)
    q, kv = rope(qkv[:, :, 0], qkv[:, :, 1:], 3)  # q with a packed kv: the same rotations
    torch.testing.assert_close(torch.cat((q[:, :, None], kv), dim=2), later)


def test_rotary_errors():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="scale_base must be positive"):
        RotaryEmbedding(8, scale_base=0)
    cos, sin = RotaryEmbedding(8).cos_sin(4, "cpu")
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_emb(torch.randn(1, 5, 1, 8), cos, sin)


def test_alibi_slopes():
    assert get_alibi_slopes(8) == pytest.approx([2.0 ** -(i + 1) for i in range(8)])
    six = get_alibi_slopes(6)
    assert six[:4] == pytest.approx(get_alibi_slopes(4)) and six[4:] == pytest.approx(get_alibi_slopes(8)[0:4:2])


def test_flash_self_and_cross_attention_cpu():
    qkv = torch.randn(2, 30, 3, 4, 16)
    ours = FlashSelfAttention(causal=True)(qkv)
    torch.testing.assert_close(ours, flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True))
    cu = torch.tensor([0, 30, 60], dtype=torch.int32)
    packed = FlashSelfAttention(causal=True)(qkv.reshape(60, 3, 4, 16), cu_seqlens=cu, max_seqlen=30)
    torch.testing.assert_close(packed.view(2, 30, 4, 16), ours)
    q, kv = torch.randn(2, 20, 4, 16), torch.randn(2, 30, 2, 2, 16)
    torch.testing.assert_close(FlashCrossAttention(window_size=(5, 5))(q, kv),
                               flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(5, 5)))


def mha_ref(m: MHA, x, x_kv=None, key_padding_mask=None, upcast=True):
    """The MHA block from its weights in plain PyTorch (float64 with upcast)."""
    dt = torch.float64 if upcast else x.dtype
    p = {n: t.to(dt) for n, t in m.named_parameters()}
    lin = lambda t, name: torch.nn.functional.linear(t.to(dt), p[name + ".weight"], p.get(name + ".bias"))
    h, hk, d = m.num_heads, m.num_heads_kv, m.head_dim
    if m.cross_attn:
        q = lin(x, "Wq").unflatten(-1, (h, d))
        kv = lin(x if x_kv is None else x_kv, "Wkv").unflatten(-1, (2, hk, d))
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        qkv = lin(x, "Wqkv")
        if m.dwconv:  # each channel: taps 0, 1, 2 on tokens t - 2, t - 1, t (zeros before the first)
            parts = ["dwconv_qkv"] if h == hk else ["dwconv_q", "dwconv_kv"]
            w = torch.cat([p[n + ".weight"] for n in parts])[:, 0]  # (channels, 3)
            b = torch.cat([p[n + ".bias"] for n in parts])
            padded = torch.nn.functional.pad(qkv, (0, 0, 2, 0))
            s = qkv.shape[1]
            qkv = sum(padded[:, j:j + s] * w[:, j] for j in range(3)) + b
        q, k, v = qkv[..., : h * d], qkv[..., h * d: (h + hk) * d], qkv[..., (h + hk) * d:]
        q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))
    if m.rotary_emb_dim:
        rope = dict(rot=m.rotary_emb_dim, base=m.rotary_emb.base, interleaved=m.rotary_emb.interleaved)
        sb = m.rotary_emb.scale_base  # (XPos centred on 0: the centre cancels in the scores)
        q = rope_ref(q, **rope, xpos=None if sb is None else (sb, 0, 1)).to(dt)
        k = rope_ref(k, **rope, xpos=None if sb is None else (sb, 0, -1)).to(dt)
    inner = m.inner_attn
    bias = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    out, _ = attention_ref(q, k, v, causal=inner.causal, window_size=inner.window_size, upcast=upcast,
                           softmax_scale=inner.softmax_scale, alibi_slopes=inner.alibi_slopes, attn_mask=bias)
    return torch.nn.functional.linear(out.to(dt).flatten(-2), p["out_proj.weight"], p.get("out_proj.bias"))


CASES = {
    "plain": dict(),
    "causal_rotary": dict(causal=True, rotary_emb_dim=16),
    "rotary_interleaved_full": dict(rotary_emb_dim=32, rotary_emb_interleaved=True),
    "gqa_rotary": dict(num_heads_kv=2, causal=True, rotary_emb_dim=8),
    "xpos_causal": dict(causal=True, rotary_emb_dim=16, rotary_emb_scale_base=32),
    "dwconv_causal_rotary": dict(causal=True, dwconv=True, rotary_emb_dim=16),
    "dwconv_gqa": dict(num_heads_kv=2, dwconv=True),
    "mqa_window": dict(num_heads_kv=1, window_size=(7, 3)),
    "alibi": dict(use_alibi=True, causal=True),
    "cross": dict(cross_attn=True, num_heads_kv=2),
    "cross_rotary_causal": dict(cross_attn=True, num_heads_kv=2, rotary_emb_dim=16, causal=True),
}


def make_mha(case, **kw):
    m = MHA(128, 4, **CASES[case], **kw)
    with torch.no_grad():
        for t in m.parameters():
            t.normal_(0, 0.1)
    return m


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("padded", [False, True])
def test_mha_matches_reference_cpu(case, padded):
    m = make_mha(case)
    x = torch.randn(2, 37, 128, requires_grad=True)
    x_kv = torch.randn(2, 29, 128) if CASES[case].get("cross_attn") else None
    kpm = None
    if padded:
        kpm = torch.ones(2, 29 if x_kv is not None else 37, dtype=torch.bool)
        kpm[1, 20:] = False
    out = m(x, x_kv=x_kv, key_padding_mask=kpm)
    ref = mha_ref(m, x, x_kv, kpm)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x] + list(m.parameters()), g)
    ref_grads = torch.autograd.grad(ref, [x] + list(m.parameters()), g.double())
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("case", ["plain", "causal_rotary", "gqa_rotary", "xpos_causal"])
def test_mha_packed_equals_each_sequence_cpu(case):
    m = make_mha(case)
    lens = [5, 0, 17, 1, 30]
    x = torch.randn(sum(lens), 128)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = m(x, cu_seqlens=cu, max_seqlen=max(lens))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > s:
            torch.testing.assert_close(out[s:e], m(x[None, s:e])[0], atol=1e-5, rtol=1e-5)


def test_mha_options_and_errors():
    m = MHA(64, 4, return_residual=True, checkpointing=True)
    x = torch.randn(2, 9, 64, requires_grad=True)
    out, res = m(x)
    assert res is x
    out.sum().backward()  # through the checkpoint
    assert x.grad is not None
    with pytest.raises(ValueError, match="divisible"):
        MHA(65, 4)
    with pytest.raises(ValueError, match="multiple of num_heads_kv"):
        MHA(64, 4, num_heads_kv=3)
    with pytest.raises(ValueError, match="mixer_subset"):
        MHA(64, 4)(x, mixer_subset=slice(0, 1))
    cross = MHA(64, 4, cross_attn=True, num_heads_kv=2)
    full = cross(x)
    for subset in (slice(0, 1), torch.tensor([5, 2])):  # queries from some rows of x, keys from all
        torch.testing.assert_close(cross(x, mixer_subset=subset), full[:, subset])
    with pytest.raises(ValueError, match="layer_idx"):
        MHA(64, 4)(x, inference_params=InferenceParams(16, 2))
    with pytest.raises(ValueError, match="excludes cu_seqlens and key_padding_mask"):
        MHA(64, 4, layer_idx=0)(x, key_padding_mask=torch.ones(2, 9, dtype=torch.bool),
                                inference_params=InferenceParams(16, 2))
    with pytest.raises(ValueError, match="max_seqlen"):
        MHA(64, 4)(x.view(18, 64), cu_seqlens=torch.tensor([0, 18], dtype=torch.int32))
    with pytest.raises(ValueError, match="key_padding_mask"):
        MHA(64, 4)(x, key_padding_mask=torch.ones(2, 8, dtype=torch.bool))
    conv = MHA(64, 4, dwconv=True, layer_idx=0)
    assert conv.dwconv_qkv.weight.shape == (192, 1, 3)
    assert MHA(64, 4, num_heads_kv=2, dwconv=True).dwconv_kv.weight.shape == (64, 1, 3)
    with pytest.raises(ValueError, match="dwconv takes x as"):
        conv(x.view(18, 64), cu_seqlens=torch.tensor([0, 18], dtype=torch.int32), max_seqlen=18)
    with pytest.raises(NotImplementedError, match="dwconv does not decode"):
        conv(x, inference_params=InferenceParams(16, 2))
    with pytest.raises(NotImplementedError, match="dwconv is for self-attention"):
        MHA(64, 4, cross_attn=True, dwconv=True)


DECODE_CASES = {"causal_rotary": CASES["causal_rotary"], "gqa_rotary": CASES["gqa_rotary"],
                "alibi": CASES["alibi"], "gqa_window": dict(num_heads_kv=2, causal=True, window_size=(5, 0)),
                "xpos_causal": CASES["xpos_causal"]}


def decode_all(m, x, prompt, ip):
    """The prompt in one call, then one token a call, each through the KV cache."""
    outs = [m(x[:, :prompt], inference_params=ip)]
    for t in range(prompt, x.shape[1]):
        ip.seqlen_offset = t
        outs.append(m(x[:, t:t + 1], inference_params=ip))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_mha_decoding_equals_full_forward_cpu(case):
    """inference_params: a prompt, then tokens decoded one at a time, equal the causal forward of
    the whole sequence, the cache allocated on first use."""
    m = MHA(128, 4, layer_idx=3, **DECODE_CASES[case])
    x = torch.randn(2, 23, 128)
    ip = InferenceParams(max_seqlen=40, max_batch_size=2)
    with torch.no_grad():
        torch.testing.assert_close(decode_all(m, x, 10, ip), m(x), atol=1e-5, rtol=1e-5)
    assert ip.key_value_memory_dict[3].shape == (2, 40, 2, m.num_heads_kv, 32)


def test_mha_decoding_lengths_per_sample_cpu():
    """Sequences of different lengths decoded together (lengths_per_sample), their prompts
    written one at a time (batch_size_offset), into a cache from allocate_inference_cache."""
    m = MHA(128, 4, num_heads_kv=2, causal=True, rotary_emb_dim=16, layer_idx=0)
    seqs = [torch.randn(1, 12, 128), torch.randn(1, 7, 128)]
    ip = InferenceParams(max_seqlen=16, max_batch_size=2)
    ip.key_value_memory_dict[0] = m.allocate_inference_cache(2, 16)
    with torch.no_grad():
        for i, x in enumerate(seqs):
            ip.batch_size_offset = i
            m(x[:, :-1], inference_params=ip)
        ip.batch_size_offset = 0
        ip.lengths_per_sample = torch.tensor([11, 6], dtype=torch.int32)
        out = m(torch.cat([x[:, -1:] for x in seqs]), inference_params=ip)
        for i, x in enumerate(seqs):
            torch.testing.assert_close(out[i, 0], m(x)[0, -1], atol=1e-5, rtol=1e-5)
    ip.reset(16, 2)
    assert ip.seqlen_offset == 0 and (ip.lengths_per_sample == 0).all() and 0 in ip.key_value_memory_dict


def test_mha_decoding_compile_fullgraph_cpu():
    """A decoding step with per-sequence lengths, compiled without graph breaks, advances its cache
    as the eager step does."""
    torch._dynamo.reset()
    m = MHA(128, 4, num_heads_kv=2, causal=True, rotary_emb_dim=16, layer_idx=0)
    ips = [InferenceParams(max_seqlen=32, max_batch_size=2, lengths_per_sample=torch.tensor([3, 7], dtype=torch.int32))
           for _ in range(2)]
    ips[0].key_value_memory_dict[0] = torch.randn(2, 32, 2, 2, 32)
    ips[1].key_value_memory_dict[0] = ips[0].key_value_memory_dict[0].clone()
    compiled = torch.compile(lambda x: m(x, inference_params=ips[1]), fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 1, 128)
            torch.testing.assert_close(compiled(x), m(x, inference_params=ips[0]), atol=1e-5, rtol=1e-5)
            for ip in ips:
                ip.lengths_per_sample += 1
    torch.testing.assert_close(ips[1].key_value_memory_dict[0], ips[0].key_value_memory_dict[0])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal_rotary", "gqa_rotary"])
def test_mha_decoding_gpu(case):
    """bf16 decoding on the GPU against the float64 reference of the whole sequence, with the
    tolerance rule's bound taken from the bf16 full forward."""
    m = make_mha(case, layer_idx=0).cuda()
    x = torch.randn(2, 300, 128, device="cuda")
    ours_m = copy.deepcopy(m).to(torch.bfloat16)
    ip = InferenceParams(max_seqlen=320, max_batch_size=2)
    with torch.no_grad():
        out = decode_all(ours_m, x.to(torch.bfloat16), 200, ip)
        ref = mha_ref(m, x.double())
        pt = mha_ref(ours_m, x.to(torch.bfloat16), upcast=False)
    check_rule("out", out, ref, pt, torch.bfloat16)


@pytest.mark.parametrize("case", ["gqa_rotary", "xpos_causal"])
def test_mha_torch_compile_fullgraph_cpu(case):
    torch._dynamo.reset()
    m = make_mha(case)
    x = torch.randn(2, 37, 128, requires_grad=True)
    explanation = torch._dynamo.explain(m)(x)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, m(x), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_mha_tolerance_rule_gpu(dtype, case):
    m = make_mha(case).cuda()
    x = torch.randn(2, 200, 128, device="cuda")
    x_kv = torch.randn(2, 150, 128, device="cuda") if CASES[case].get("cross_attn") else None
    kpm = torch.ones(2, 150 if x_kv is not None else 200, dtype=torch.bool, device="cuda")
    kpm[1, 100:] = False
    ours_m = copy.deepcopy(m).to(dtype)
    xs = x.to(dtype).requires_grad_()
    out = ours_m(xs, x_kv=None if x_kv is None else x_kv.to(dtype), key_padding_mask=kpm)
    x64 = x.double().requires_grad_()
    ref = mha_ref(m, x64, x_kv, kpm)
    xl = x.to(dtype).requires_grad_()
    pt = mha_ref(ours_m, xl, None if x_kv is None else x_kv.to(dtype), kpm, upcast=False)
    check_rule("out", out, ref, pt, dtype)
    g = torch.randn_like(ref)
    gx, = torch.autograd.grad(out, xs, g.to(dtype))
    rx, = torch.autograd.grad(ref, x64, g)
    px, = torch.autograd.grad(pt, xl, g.to(dtype))
    check_rule("dx", gx, rx, px, dtype)
    assert math.isfinite(out.float().sum().item())
