"""The custom-op contract: opcheck (schema, fake tensors, autograd registration, AOT dispatch)
and torch.compile(fullgraph=True) of a model that uses the API, forward and backward."""

import pytest
import torch

import flash_attn
from flash_attn import BlockSparseMask, flash_attn_blocksparse_func, flash_attn_func
from reference import attention_ref


def qkv(dtype=torch.float32, sq=37, sk=53, h=4, hk=2, d=32, requires_grad=True):
    return (torch.randn(2, sq, h, d, dtype=dtype, requires_grad=requires_grad),
            torch.randn(2, sk, hk, d, dtype=dtype, requires_grad=requires_grad),
            torch.randn(2, sk, hk, d, dtype=dtype, requires_grad=requires_grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("return_softmax", [False, True])
def test_opcheck_fwd(dtype, causal, return_softmax):
    q, k, v = qkv(dtype)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, (q, k, v, 0.0, None, causal, -1, -1, return_softmax, False))


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_opcheck_bwd(dropout_p):
    q, k, v = qkv(requires_grad=False)
    out, lse, _, rng_state = torch.ops.flash_attn.fwd(q, k, v, dropout_p, None, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flash_attn.bwd.default,
                          (dout, q, k, v, out, lse, dropout_p, None, True, -1, -1, False, rng_state))


class TinyAttentionBlock(torch.nn.Module):
    def __init__(self, dim=64, heads=4, dropout_p=0.0):
        super().__init__()
        self.heads, self.dropout_p = heads, dropout_p
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads)
        out = flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p=self.dropout_p, causal=True)
        return self.proj(out.reshape(b, s, dim))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()
    model = TinyAttentionBlock()
    x = torch.randn(2, 50, 64, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = compiled(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    ref = model(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, [p.grad for p in model.parameters()] + [x.grad]):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_torch_compile_with_dropout_has_no_graph_break():
    torch._dynamo.reset()
    model = TinyAttentionBlock(dropout_p=0.1)
    explanation = torch._dynamo.explain(model)(torch.randn(2, 50, 64))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 50, 64, requires_grad=True)
    compiled(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = qkv(requires_grad=False)
        out, lse, probs, rng = torch.ops.flash_attn.fwd(q, k, v, 0.0, None, False, -1, -1, True)
        assert out.shape == q.shape and lse.shape == (2, 4, 37) and probs.shape == (2, 4, 37, 53)
        assert rng.shape == (2,) and rng.dtype == torch.int64


def test_autograd_node_is_cpp_and_takes_any_gradient_layout():
    # The backward node is the C++ one (no Python runs between forward and backward), and it takes
    # an upstream gradient whose last dim is not unit-stride (out.sum() gives stride 0).
    q, k, v = qkv(sq=9, sk=9, hk=4)
    out = flash_attn_func(q, k, v, causal=True)
    assert "FlashAttnFunction" in out.grad_fn.name()
    out.sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    attention_ref(q.double(), k.double(), v.double(), causal=True)[0].sum().backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad.float(), atol=1e-4, rtol=1e-4)


def test_torch_compile_blocksparse_forward_backward():
    torch._dynamo.reset()
    q, k, v = qkv(sq=200, sk=200, hk=4)
    mask = BlockSparseMask.from_layout(torch.tensor([[True, False], [True, True]]), 200, 200)
    fn = torch.compile(lambda q, k, v: flash_attn_blocksparse_func(q, k, v, mask), fullgraph=True, backend="aot_eager")
    fn(q, k, v).square().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flash_attn_blocksparse_func(q, k, v, mask).square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-5)


def test_version():
    assert isinstance(flash_attn.__version__, str) and flash_attn.__version__.count(".") == 2


def test_flash_attn_2x_module_paths():
    """The import paths code written for flash-attn 2.x uses name the package's own objects."""
    from flash_attn import flash_attn_interface
    from flash_attn.bert_padding import pad_input, unpad_input  # noqa: F401
    from flash_attn.layers.rotary import apply_rotary_emb_func  # noqa: F401
    from flash_attn.modules.mha import MHA  # noqa: F401
    from flash_attn.utils.generation import InferenceParams  # noqa: F401
    for name in flash_attn_interface.__all__:
        assert getattr(flash_attn_interface, name) is getattr(flash_attn, name)
