"""Hugging Face transformers integration: BERT and GPT-2 built from configs (no download) with
attn_implementation=register() against attn_implementation="eager" with the same weights,
padding on either side; torch.compile(fullgraph=True) with no graph break; on the GPU the
tolerance rule in bf16 and mode="reduce-overhead". Skipped without transformers."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (AutoModel, AutoModelForCausalLM, BertConfig, GPT2Config, GptOssConfig,  # noqa: E402
                          LlamaConfig, T5Config)

import flash_attn.integrations.transformers as integration  # noqa: E402
from flash_attn.integrations.transformers import register  # noqa: E402
from reference import EPS  # noqa: E402

transformers.utils.logging.set_verbosity_error()
NAME = register()

CONFIGS = {
    "bert": lambda: BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                               vocab_size=100, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, attn_pdrop=0.0, resid_pdrop=0.0,
                               embd_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}


def models(kind, device="cpu"):
    """(eager, ours) with the same weights; each gets its own config (from_config writes the
    implementation into the config it is given)."""
    eager = AutoModel.from_config(CONFIGS[kind](), attn_implementation="eager").to(device)
    ours = AutoModel.from_config(CONFIGS[kind](), attn_implementation=NAME).to(device)
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == NAME and eager.config._attn_implementation == "eager"
    return eager, ours


def batch(padding, device="cpu", length=17):
    ids = torch.randint(0, 100, (2, length), device=device)
    mask = torch.ones(2, length, dtype=torch.long, device=device)
    if padding == "right":
        mask[1, length - 6:] = 0
    elif padding == "left":
        mask[1, :6] = 0
    return ids, mask


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_matches_eager_cpu(kind, padding):
    eager, ours = models(kind)
    ids, mask = batch(padding)
    real = mask.bool()
    weight = torch.randn(2, 17, 64)
    results = []
    for m in (eager, ours):
        hidden = m(input_ids=ids, attention_mask=None if padding == "none" else mask).last_hidden_state
        loss = (hidden * weight)[real].sum()  # padded query rows differ by design (see the module)
        grads = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)
        results.append((hidden[real], grads))
    (h_e, g_e), (h_o, g_o) = results
    torch.testing.assert_close(h_o, h_e, atol=2e-5, rtol=1e-4)
    for a, b in zip(g_o, g_e):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3)


LM_CONFIGS = {
    "gpt2": CONFIGS["gpt2"],
    "llama": lambda: LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=100),  # (rotary and GQA)
}


def packed(lengths):
    """input_ids (1, total), position_ids restarting at each sequence, and transformers' flash
    kwargs for them, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes them."""
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    ids = torch.randint(0, 100, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                                max_length_k=max(lengths))


def gpt_oss_config():
    """gpt-oss: attention sinks (s_aux) on every layer, a sliding-window layer (a 4-D mask) and a
    full one (padding mask and the causal flag), GQA, experts."""
    return GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=5, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("padding", ["none", "left"])
def test_gpt_oss_sinks_match_eager_cpu(padding):
    """The sinks join every row's softmax: logits and every parameter's gradient (the sinks'
    included, through the training path) and the no-gradient path equal eager attention's."""
    eager = AutoModelForCausalLM.from_config(gpt_oss_config(), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(gpt_oss_config(), attn_implementation=NAME)
    ours.load_state_dict(eager.state_dict())
    ids, mask = batch(padding, length=12)
    am = None if padding == "none" else mask
    real = mask.bool()
    results = []
    for m in (eager, ours):
        logits = m(input_ids=ids, attention_mask=am).logits[real]
        names, params = zip(*m.named_parameters())
        results.append((logits, torch.autograd.grad((logits * torch.arange(100)).sum(), params, allow_unused=True)))
        with torch.no_grad():
            results[-1] += (m(input_ids=ids, attention_mask=am).logits[real],)
    assert any("sinks" in n for n in names)
    (l_e, g_e, n_e), (l_o, g_o, n_o) = results
    torch.testing.assert_close(l_o, l_e, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(n_o, n_e, atol=2e-5, rtol=1e-4)
    for name, a, b in zip(names, g_o, g_e):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3, msg=name)


def test_t5_position_bias_matches_eager_cpu():
    """T5 hands its relative-position bias to the attention function (position_bias): added to the
    scores with the padding mask, its embedding gets the gradient eager attention gives it."""
    config = lambda: T5Config(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
                              vocab_size=100, dropout_rate=0.0, relative_attention_num_buckets=8,
                              relative_attention_max_distance=20)
    eager = AutoModel.from_config(config(), attn_implementation="eager")
    ours = AutoModel.from_config(config(), attn_implementation=NAME)
    ours.load_state_dict(eager.state_dict())
    ids, mask = batch("right", length=12)
    dec = torch.randint(0, 100, (2, 7))
    weight = torch.randn(2, 7, 64)
    results = []
    for m in (eager, ours):
        hidden = m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).last_hidden_state
        names, params = zip(*m.named_parameters())
        results.append((hidden, torch.autograd.grad((hidden * weight).sum(), params, allow_unused=True)))
    (h_e, g_e), (h_o, g_o) = results
    torch.testing.assert_close(h_o, h_e, atol=2e-5, rtol=1e-4)
    assert any("relative_attention_bias" in n for n in names)
    for name, a, b in zip(names, g_o, g_e):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("per_row", [False, True])
def test_sinks_and_position_bias_match_eager_formula(per_row):
    """attention_forward with sinks (s_aux (heads,), or sinks (batch, heads, seqlen_q, 1) per row),
    a position_bias and a padding mask against the eager formula in float64: softmax over [scores +
    position_bias + mask, sink], the sink's column dropped. Both paths: without gradients, and with
    them (every input's gradient)."""
    b, h, hk, s, d = 2, 4, 2, 11, 16
    q = torch.randn(b, h, s, d, dtype=torch.float64)
    k, v = torch.randn(b, hk, s, d, dtype=torch.float64), torch.randn(b, hk, s, d, dtype=torch.float64)
    sinks = torch.randn(b, h, s, 1, dtype=torch.float64) if per_row else torch.randn(h, dtype=torch.float64)
    pos = torch.randn(1, h, s, s, dtype=torch.float64)
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[1, 7:] = False

    def eager(q, k, v, sinks, pos):
        k, v = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
        w = q @ k.transpose(2, 3) * d ** -0.5 + pos + torch.where(pad, 0.0, float("-inf"))[:, None, None, :]
        sink = sinks if per_row else sinks[None, :, None, None].expand(b, h, s, 1)
        return (torch.softmax(torch.cat([w, sink], -1), -1)[..., :-1] @ v).transpose(1, 2)

    want = eager(q, k, v, sinks, pos)
    kw = dict(sinks=sinks.float()) if per_row else dict(s_aux=sinks.float())
    with torch.no_grad():
        out, _ = integration.attention_forward(torch.nn.Module(), q.float(), k.float(), v.float(), pad,
                                               scaling=d ** -0.5, position_bias=pos.float(), **kw)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    leaves = [t.float().requires_grad_() for t in (q, k, v, sinks, pos)]
    kw = dict(sinks=leaves[3]) if per_row else dict(s_aux=leaves[3])
    out, _ = integration.attention_forward(torch.nn.Module(), *leaves[:3], pad, scaling=d ** -0.5,
                                           position_bias=leaves[4], **kw)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(want)
    grads = torch.autograd.grad(out, leaves, g.float())
    ref = [t.clone().requires_grad_() for t in (q, k, v, sinks, pos)]
    ref_grads = torch.autograd.grad(eager(*ref), ref, g)
    for name, a, r in zip("q k v sinks position_bias".split(), grads, ref_grads):
        torch.testing.assert_close(a.double(), r, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_sparse_indices_match_eager_formula(mask):
    """indices (DeepSeek sparse attention, (batch, q_len, topk)): each query sees only its selected
    keys, within transformers' 4-D mask (bool, or additive with finfo.min), as eager applies them."""
    b, h, s, d, topk = 2, 4, 13, 16, 5
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    idx = torch.stack([torch.stack([torch.randperm(i + 1)[:topk] if i + 1 >= topk else
                                    torch.arange(i + 1).repeat(topk)[:topk] for i in range(s)]) for _ in range(b)])
    keep = torch.zeros(b, s, s, dtype=torch.bool).scatter(-1, idx, True)[:, None] & causal
    w = q @ k.transpose(2, 3) * d ** -0.5
    want = (torch.softmax(w.masked_fill(~keep, float("-inf")), -1) @ v).transpose(1, 2)
    am = causal if mask == "bool" else torch.zeros(b, 1, s, s).masked_fill(~causal, torch.finfo(torch.float32).min)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out, _ = integration.attention_forward(torch.nn.Module(), *leaves, am, scaling=d ** -0.5, indices=idx.int())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(want)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    w = ref[0] @ ref[1].transpose(2, 3) * d ** -0.5
    ref_out = (torch.softmax(w.masked_fill(~keep, float("-inf")), -1) @ ref[2]).transpose(1, 2)
    for a, r in zip(torch.autograd.grad(out, leaves, g.float()), torch.autograd.grad(ref_out, ref, g)):
        torch.testing.assert_close(a.double(), r, atol=1e-4, rtol=1e-4)


def test_unsupported_arguments_raise():
    q = torch.randn(1, 4, 10, 16)
    with pytest.raises(NotImplementedError, match="block_indices"):
        integration.attention_forward(torch.nn.Module(), q, q, q, None, block_indices=torch.zeros(1, 1, 10, 2))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sinks"):
        integration.attention_forward(torch.nn.Module(), q, q, q, None, is_causal=True, s_aux=torch.zeros(4),
                                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)


@pytest.mark.parametrize("kind", list(LM_CONFIGS))
@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_sequences_with_flash_kwargs(kind, use_cache, monkeypatch):
    # Each packed sequence as if alone (eager on each one), through one varlen call per layer. With
    # use_cache=True transformers builds no packed mask: the flash kwargs alone carry the packing.
    lengths = [5, 1, 9, 3]
    eager = AutoModelForCausalLM.from_config(LM_CONFIGS[kind](), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(LM_CONFIGS[kind](), attn_implementation=NAME)
    ours.load_state_dict(eager.state_dict())
    calls = []
    varlen = integration.flash_attn_varlen_func
    monkeypatch.setattr(integration, "flash_attn_varlen_func", lambda *a, **kw: calls.append(1) or varlen(*a, **kw))
    ids, positions, flash_kwargs = packed(lengths)
    weight = torch.randn(1, sum(lengths), 100)
    logits = ours(input_ids=ids, position_ids=positions, use_cache=use_cache, **flash_kwargs).logits
    grads = torch.autograd.grad((logits * weight).sum(), list(ours.parameters()))
    assert len(calls) == 2  # one per layer
    starts = [0] + torch.tensor(lengths).cumsum(0).tolist()
    alone = [eager(input_ids=ids[:, a:b]).logits for a, b in zip(starts[:-1], starts[1:])]
    ref = torch.cat(alone, dim=1)
    ref_grads = torch.autograd.grad((ref * weight).sum(), list(eager.parameters()))
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-4)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3)


def test_packed_training_step_compiles_fullgraph_cpu():
    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_config(LM_CONFIGS["llama"](), attn_implementation=NAME)
    ids, positions, flash_kwargs = packed([7, 4, 12])

    def step(ids, positions):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False, **flash_kwargs).logits
        return torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])

    explanation = torch._dynamo.explain(step)(ids, positions)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(ids, positions)
    torch.testing.assert_close(loss, step(ids, positions), atol=1e-5, rtol=1e-5)


def test_transformers_own_flash_attention_2_path_runs_on_ours(monkeypatch):
    # transformers' flash_attention_2 code (unpadding, sliding window + softcap, packing read from
    # position_ids) imports flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
    # pad_input and unpad_input from the installed flash_attn: with ours it runs unchanged. (It
    # selects that path only for a flash_attn of version >= 2.3.3, hence the patched check.)
    fau = pytest.importorskip("transformers.modeling_flash_attention_utils")
    if not all(hasattr(fau, name) for name in ("_flash_attention_forward", "is_flash_attn_2_available",
                                               "_loaded_implementation")):
        pytest.skip("transformers' flash-attention internals have moved")
    for name in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                 "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        monkeypatch.setattr(fau, name, getattr(fau, name, None))  # restored afterwards
    monkeypatch.setattr(fau, "is_flash_attn_2_available", lambda *args, **kwargs: True)
    from flash_attn import flash_attn_func

    def hf(q, k, v, mask, **kw):
        return fau._flash_attention_forward(q, k, v, mask, q.shape[1], is_causal=True,
                                            attn_implementation="flash_attention_2", **kw)

    b, s, h, d = 2, 17, 4, 16
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 11:] = 0
    out = hf(q, k, v, mask)
    ref = flash_attn_func(q, k, v, causal=True, attn_bias=mask.bool()[:, None, None, :])
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-6, rtol=1e-5)
    assert (out[1, 11:] == 0).all()
    torch.testing.assert_close(hf(q, k, v, None, sliding_window=5, softcap=3.0),
                               flash_attn_func(q, k, v, causal=True, window_size=(4, 0), softcap=3.0))
    positions = torch.cat([torch.arange(9), torch.arange(8)])[None]
    one = [x[:1] for x in (q, k, v)]
    alone = [flash_attn_func(*(x[:, a:e] for x in one), causal=True) for a, e in ((0, 9), (9, 17))]
    torch.testing.assert_close(hf(*one, None, position_ids=positions), torch.cat(alone, dim=1))


def test_register_rejects_flash_names():
    with pytest.raises(ValueError, match="flash"):
        register("flash_mine")


def lm_step(model, ids, mask):
    """Next-token loss from the logits (transformers' own loss_function breaks the graph)."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def test_gpt2_training_step_compiles_fullgraph_cpu():
    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_config(CONFIGS["gpt2"](), attn_implementation=NAME)
    ids, mask = batch("right")
    explanation = torch._dynamo.explain(lm_step)(model, ids, mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(lm_step, fullgraph=True, backend="aot_eager")
    loss = compiled(model, ids, mask)
    loss.backward()
    torch.testing.assert_close(loss, lm_step(model, ids, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpt_oss_sinks_bf16_tolerance_rule_gpu():
    eager = AutoModelForCausalLM.from_config(gpt_oss_config(), attn_implementation="eager").cuda()
    ours = AutoModelForCausalLM.from_config(gpt_oss_config(), attn_implementation=NAME).cuda()
    ours.load_state_dict(eager.state_dict())
    ids, mask = batch("left", "cuda", length=300)
    real = mask.bool()
    # (A float32 reference: the experts' grouped matmul takes no float64, on the CPU or CUDA.)
    ref = copy.deepcopy(eager)(input_ids=ids, attention_mask=mask).logits[real].double()
    pt = eager.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits[real]
    for grad in (False, True):  # the no-gradient path and the training one
        with torch.set_grad_enabled(grad):
            out = ours.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits[real]
        err, pt_err = (out.double() - ref).abs().max().item(), (pt.double() - ref).abs().max().item()
        assert err <= 2 * pt_err + EPS[torch.bfloat16] * ref.abs().max().item(), (grad, err, pt_err)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("padding", ["none", "right"])
def test_bf16_tolerance_rule_gpu(kind, padding):
    eager, ours = models(kind, "cuda")
    ids, mask = batch(padding, "cuda", length=300)
    am = None if padding == "none" else mask
    ref = eager.double()(input_ids=ids, attention_mask=am).last_hidden_state
    eager_lp = copy.deepcopy(eager).to(torch.bfloat16)
    pt = eager_lp(input_ids=ids, attention_mask=am).last_hidden_state
    out = ours.to(torch.bfloat16)(input_ids=ids, attention_mask=am).last_hidden_state
    real = mask.bool()
    err = (out.double() - ref)[real].abs().max().item()
    pt_err = (pt.double() - ref)[real].abs().max().item()
    assert err <= 2 * pt_err + EPS[torch.bfloat16] * ref[real].abs().max().item()


@pytest.mark.gpu
def test_packed_bf16_tolerance_rule_gpu():
    eager = AutoModelForCausalLM.from_config(LM_CONFIGS["llama"](), attn_implementation="eager").cuda()
    ours = AutoModelForCausalLM.from_config(LM_CONFIGS["llama"](), attn_implementation=NAME).cuda()
    ours.load_state_dict(eager.state_dict())
    lengths = [100, 37, 250, 1, 129]
    ids, positions, flash_kwargs = packed(lengths)
    ids, positions = ids.cuda(), positions.cuda()
    flash_kwargs.update(cu_seq_lens_q=flash_kwargs["cu_seq_lens_q"].cuda(), cu_seq_lens_k=flash_kwargs["cu_seq_lens_k"].cuda())
    starts = [0] + torch.tensor(lengths).cumsum(0).tolist()

    def alone(model):
        return torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(starts[:-1], starts[1:])], dim=1)

    ref = alone(copy.deepcopy(eager).double())
    pt = alone(eager.to(torch.bfloat16))
    out = ours.to(torch.bfloat16)(input_ids=ids, position_ids=positions, use_cache=False, **flash_kwargs).logits
    err, pt_err = (out.double() - ref).abs().max().item(), (pt.double() - ref).abs().max().item()
    assert err <= 2 * pt_err + EPS[torch.bfloat16] * ref.abs().max().item()


@pytest.mark.gpu
def test_gpt2_reduce_overhead_gpu():
    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_config(CONFIGS["gpt2"](), attn_implementation=NAME).cuda()
    ids, mask = batch("none", "cuda", length=256)
    compiled = torch.compile(lm_step, mode="reduce-overhead", fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = [compiled(model, ids, None) for _ in range(3)]
        for loss in losses:
            assert torch.isfinite(loss)
        eager_loss = lm_step(model, ids, None)
    torch.testing.assert_close(losses[-1].float(), eager_loss.float(), atol=2e-2, rtol=2e-2)
