"""flash_attn.modules.MultiheadAttention against torch.nn.MultiheadAttention with the same weights:
outputs, input and parameter gradients, every constructor option and mask form, need_weights,
state_dict, replace_attention on a TransformerEncoder, torch.compile; on the CPU in float32 (exact
comparison) and bfloat16, on the GPU in bfloat16 (the tolerance rule against float64)."""

import copy

import pytest
import torch
from torch import nn

from flash_attn import replace_attention
from flash_attn.modules import MultiheadAttention
from reference import EPS, check_rule

E, H = 64, 4


def pair(**kw):
    """A torch layer and ours with its weights (biases randomised too, so they are exercised)."""
    ref = nn.MultiheadAttention(E, H, **kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ours = MultiheadAttention(E, H, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def inputs(batch_first, batched=True, lq=37, lk=37, kdim=E, vdim=E, cross=False, dtype=torch.float32,
           device="cpu"):
    def make(length, dim):
        shape = ((2, length, dim) if batch_first else (length, 2, dim)) if batched else (length, dim)
        return torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    q = make(lq, E)
    if not cross:
        return q, q, q
    return q, make(lk, kdim), make(lk, vdim)


def run(layer, q, k, v, **kw):
    out, weights = layer(q, k, v, **kw)
    dout = torch.ones_like(out) if out.numel() else out
    grads = torch.autograd.grad(out, [t for t in {id(x): x for x in (q, k, v)}.values()] + list(layer.parameters()),
                                dout * torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device)
                                .view_as(out))
    return out, weights, grads


def assert_same(ref, ours, q, k, v, atol=2e-5, **kw):
    out_r, w_r, g_r = run(ref, q, k, v, **kw)
    out_o, w_o, g_o = run(ours, q, k, v, **kw)
    torch.testing.assert_close(out_o, out_r, atol=atol, rtol=1e-4)
    assert (w_r is None) == (w_o is None)
    if w_r is not None:
        torch.testing.assert_close(w_o, w_r, atol=atol, rtol=1e-4)
    for a, b in zip(g_o, g_r):
        torch.testing.assert_close(a, b, atol=atol * 10, rtol=1e-3)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_matches_torch_cpu(batch_first, bias, cross):
    ref, ours = pair(batch_first=batch_first, bias=bias)
    assert_same(ref, ours, *inputs(batch_first, cross=cross, lk=29), need_weights=False)


@pytest.mark.parametrize("kw", [dict(kdim=24, vdim=40), dict(add_bias_kv=True), dict(add_zero_attn=True),
                                dict(add_bias_kv=True, add_zero_attn=True)], ids=str)
def test_constructor_options_cpu(kw):
    ref, ours = pair(batch_first=True, **kw)
    q, k, v = inputs(True, cross=True, lk=29, kdim=kw.get("kdim", E), vdim=kw.get("vdim", E))
    kpm = torch.rand(2, 29) < 0.3
    assert_same(ref, ours, q, k, v, need_weights=False)
    assert_same(ref, ours, q, k, v, key_padding_mask=kpm, need_weights=False)


def test_unbatched_cpu():
    ref, ours = pair()
    q, k, v = inputs(False, batched=False, cross=True, lk=11)
    assert_same(ref, ours, q, k, v, key_padding_mask=torch.rand(11) < 0.3, need_weights=False)


@pytest.mark.parametrize("kpm_kind", [None, "bool", "float"])
@pytest.mark.parametrize("mask_kind", [None, "bool2d", "float2d", "bool3d", "float3d"])
def test_masks_cpu(kpm_kind, mask_kind):
    ref, ours = pair(batch_first=True)
    q, k, v = inputs(True, cross=True, lq=21, lk=30)
    hidden = torch.rand(2, 30) < 0.3
    hidden[:, 0] = False  # every row keeps a key: PyTorch gives NaN for fully masked rows
    kpm = {None: None, "bool": hidden, "float": torch.randn(2, 30)}[kpm_kind]
    shape = (21, 30) if mask_kind and mask_kind.endswith("2d") else (2 * H, 21, 30)
    am_hidden = torch.rand(shape) < 0.3
    am_hidden[..., 0] = False
    am = {None: None, "bool2d": am_hidden, "bool3d": am_hidden, "float2d": torch.randn(shape),
          "float3d": torch.randn(shape)}[mask_kind]
    assert_same(ref, ours, q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=False)


@pytest.mark.parametrize("with_kpm", [False, True])
@pytest.mark.parametrize("kw", [{}, dict(add_bias_kv=True, add_zero_attn=True)], ids=str)
def test_is_causal_cpu(with_kpm, kw):
    ref, ours = pair(batch_first=True, **kw)
    q, k, v = inputs(True)
    causal = nn.Transformer.generate_square_subsequent_mask(37)
    kpm = torch.zeros(2, 37, dtype=torch.bool)
    kpm[1, 30:] = True
    assert_same(ref, ours, q, k, v, attn_mask=causal, is_causal=True,
                key_padding_mask=kpm if with_kpm else None, need_weights=False)


@pytest.mark.parametrize("average", [True, False])
def test_need_weights_cpu(average):
    ref, ours = pair(batch_first=True)
    q, k, v = inputs(True, cross=True, lk=13)
    assert_same(ref, ours, q, k, v, need_weights=True, average_attn_weights=average,
                key_padding_mask=torch.rand(2, 13) < 0.2)


def test_dropout_in_training_only_cpu():
    ref, ours = pair(batch_first=True, dropout=0.5)
    q, k, v = inputs(True)
    ours.eval(), ref.eval()
    assert_same(ref, ours, q, k, v, need_weights=False)
    ours.train()
    a, _ = ours(q, k, v, need_weights=False)
    b, _ = ours(q, k, v, need_weights=False)
    assert torch.isfinite(a).all() and not torch.equal(a, b)


def test_fully_masked_rows_give_zero_attention_cpu():
    ref, ours = pair(batch_first=True)
    q, k, v = inputs(True, cross=True, lk=8)
    kpm = torch.zeros(2, 8, dtype=torch.bool)
    kpm[1] = True  # sequence 1 sees no key
    out, _ = ours(q, k, v, key_padding_mask=kpm, need_weights=False)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1], ours.out_proj.bias.expand_as(out[1]))  # attention 0, then out_proj
    out_r, _ = ref(q, k, v, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out[0], out_r[0], atol=2e-5, rtol=1e-4)


def test_state_dict_and_parameters_are_torchs():
    for kw in ({}, dict(kdim=24, vdim=40, add_bias_kv=True, bias=False)):
        ref, ours = pair(**kw)
        assert list(ours.state_dict()) == list(ref.state_dict())
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
        back = nn.MultiheadAttention(E, H, **kw)
        back.load_state_dict(ours.state_dict())


def test_errors_name_the_argument():
    _, ours = pair(batch_first=True)
    q = torch.randn(2, 10, E)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ours(q, q, q, is_causal=True, need_weights=False)
    with pytest.raises(AssertionError, match="key_padding_mask"):
        ours(q, q, q, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool), need_weights=False)
    with pytest.raises(RuntimeError, match="attn_mask"):
        ours(q, q, q, attn_mask=torch.zeros(9, 10, dtype=torch.bool), need_weights=False)
    with pytest.raises(AssertionError, match="embedding dimension"):
        ours(torch.randn(2, 10, E + 8), q, q, need_weights=False)


def encoder(batch_first=True, layers=2):
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=96, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


@pytest.mark.parametrize("batch_first", [True, False])
def test_replace_attention_keeps_transformer_encoder_cpu(batch_first):
    model = encoder(batch_first)
    swapped = replace_attention(copy.deepcopy(model))
    assert all(type(layer.self_attn) is MultiheadAttention for layer in swapped.layers)
    x = torch.randn((2, 37, E) if batch_first else (37, 2, E))
    kpm = torch.zeros(2, 37, dtype=torch.bool)
    kpm[0, 25:] = True
    mask = nn.Transformer.generate_square_subsequent_mask(37)
    for kw in (dict(src_key_padding_mask=kpm), dict(mask=mask, is_causal=True)):
        outs, grads = [], []
        for m in (model, swapped):
            m.zero_grad()
            out = m(x, **kw)
            out.square().sum().backward()
            outs.append(out)
            grads.append([p.grad.clone() for p in m.parameters()])
        torch.testing.assert_close(outs[1], outs[0], atol=3e-5, rtol=1e-4)
        for a, b in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, b, atol=3e-4, rtol=1e-3)


def test_replace_attention_swaps_in_place():
    model = nn.Sequential(nn.MultiheadAttention(E, H), nn.Linear(E, E))
    weight = model[0].in_proj_weight
    assert replace_attention(model) is model
    assert type(model[0]) is MultiheadAttention and model[0].in_proj_weight is weight
    mha = nn.MultiheadAttention(E, H)
    assert type(replace_attention(mha)) is MultiheadAttention


def test_torch_compile_fullgraph_cpu():
    torch._dynamo.reset()
    model = encoder()
    replace_attention(model)
    x = torch.randn(2, 37, E, requires_grad=True)
    kpm = torch.zeros(2, 37, dtype=torch.bool)
    kpm[1, 20:] = True
    explanation = torch._dynamo.explain(model)(x, src_key_padding_mask=kpm)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x, src_key_padding_mask=kpm)
    out.sum().backward()
    torch.testing.assert_close(out, model(x, src_key_padding_mask=kpm), atol=1e-5, rtol=1e-5)


def lowp_check(device, dtype, cross, kw, mask_kw):
    """Ours in dtype against torch's layer in float64 (the reference) and in dtype (PyTorch's own
    error), outputs and every gradient."""
    ref, ours = pair(batch_first=True, **kw)
    ref64 = copy.deepcopy(ref).double().to(device)
    ref_lp = copy.deepcopy(ref).to(device, dtype)
    ours = ours.to(device, dtype)
    q, k, v = inputs(True, cross=cross, lq=70, lk=53 if cross else 70, dtype=dtype, device=device)
    mask_kw = {name: (m.to(device) if m is not None else None) for name, m in mask_kw.items()}
    results = []
    for layer in (ours, ref_lp, ref64):
        leaves = [t.detach().to(torch.float64 if layer is ref64 else dtype).requires_grad_()
                  for t in {id(x): x for x in (q, k, v)}.values()]
        qq, kk, vv = (leaves * 3)[:3] if not cross else leaves
        # A float mask in the layer's dtype, as a model in that dtype would hold it.
        masks = {n: (m.to(torch.float64 if layer is ref64 else dtype) if m is not None and m.is_floating_point() else m)
                 for n, m in mask_kw.items()}
        out, _ = layer(qq, kk, vv, need_weights=False, **masks)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, out.dtype)
        grads = torch.autograd.grad(out, leaves + list(layer.parameters()), dout)
        results.append((out, grads))
    (o, g), (p, pg), (r, rg) = results
    check_rule("out", o, r, p, dtype)
    for i, (a, b, c) in enumerate(zip(g, rg, pg)):
        check_rule(f"grad {i}", a, b, c, dtype)


@pytest.mark.parametrize("cross", [False, True])
def test_bf16_tolerance_rule_cpu(cross):
    kpm = torch.rand(2, 53 if cross else 70) < 0.2
    kpm[:, 0] = False
    lowp_check("cpu", torch.bfloat16, cross, {}, dict(key_padding_mask=kpm))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("case", ["plain", "kpm", "mask3d", "bias_kv"])
def test_tolerance_rule_gpu(dtype, cross, case):
    lk = 53 if cross else 70
    kpm = torch.rand(2, lk) < 0.2
    kpm[:, 0] = False
    mask_kw = {"plain": {}, "kpm": dict(key_padding_mask=kpm),
               "mask3d": dict(attn_mask=torch.randn(2 * H, 70, lk)), "bias_kv": dict(key_padding_mask=kpm)}[case]
    kw = dict(add_bias_kv=True, add_zero_attn=True) if case == "bias_kv" else {}
    lowp_check("cuda", dtype, cross, kw, mask_kw)


@pytest.mark.gpu
def test_replace_attention_encoder_autocast_gpu():
    model = encoder().cuda()
    swapped = replace_attention(copy.deepcopy(model))
    x = torch.randn(4, 200, E, device="cuda")
    mask = nn.Transformer.generate_square_subsequent_mask(200, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = swapped(x, mask=mask, is_causal=True)
        theirs = model(x, mask=mask, is_causal=True)
    ref = model.double()(x.double(), mask=mask.double(), is_causal=True)
    err, pt_err = (ours.double() - ref).abs().max().item(), (theirs.double() - ref).abs().max().item()
    assert err <= 2 * pt_err + EPS[torch.bfloat16] * ref.abs().max().item()
