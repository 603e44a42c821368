"""Kernels other than exp (poly2, elu), linear attention and Performer (FAVOR+): each against its quadratic definition
in float64 (forward and gradients), leak tests, padding, half precision, decoding state, redraw, errors, compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import leaks
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import (
    Inputs,
    KernelOptions,
    LinearOptions,
    LocalOptions,
    PerformerOptions,
    RelativePositions,
    full_attention,
    kernel_attention,
    linear_attention,
    local_attention,
    orthogonal_features,
    performer_attention,
    reference_attention,
)
from routeformer.attention.kernels import attend_cached_kernel, feature_dim, feature_map, pairwise
from routeformer.attention.linear import LinearState
from routeformer.attention.performer import performer_features

B, H, N, D = 2, 3, 37, 6


def qkv(dtype=torch.float64, seed=0, n=N, d=D, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, d, generator=g, dtype=dtype) * spread for _ in range(3)]


def literal_kernel(kernel: str, q, k, scale: float):
    """K(q_i, k_j) written out from the definitions, pair by pair in float64."""
    if kernel == "poly2":
        return (1 + torch.einsum("bhid,bhjd->bhij", q, k) * scale) ** 2
    def phi(x):
        return torch.where(x > 0, x + 1, torch.exp(x))  # elu(x) + 1
    return torch.einsum("bhid,bhjd->bhij", phi(q), phi(k))


def quadratic(kernel, q, k, v, mask, scale):
    """o_i = Σ_j K_ij v_j / Σ_j K_ij over the allowed j (zeros for a row with none)."""
    w = literal_kernel(kernel, q, k, scale) * mask
    total = w.sum(-1, keepdim=True)
    return (w @ v) / torch.where(total > 0, total, 1.0)


def causal_mask(n, window=None, causal=True, valid=None):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    m = (j <= i) if causal else torch.ones(n, n, dtype=torch.bool)
    if window is not None:
        m = m & ((i - j).abs() < window)
    m = m[None, None]
    return m & valid[:, None, None, :] if valid is not None else m


def grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(7))
    return out, torch.autograd.grad(out, xs, g)


def assert_close_with_grads(fn, ref, *xs, tol=1e-12):
    out, g = grads(fn, *xs)
    want, g_ref = grads(ref, *xs)
    assert (out - want).abs().max() <= tol
    for a, b in zip(g, g_ref, strict=True):
        assert (a - b).abs().max() <= tol


# --- the kernels ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["poly2", "elu"])
def test_feature_maps_reproduce_their_kernels(kernel) -> None:
    q, k, _ = qkv()
    scale = 1.0 if kernel == "elu" else 0.37
    fq, fk = feature_map(kernel, q, scale), feature_map(kernel, k, scale)
    assert fq.shape[-1] == feature_dim(kernel, D)
    assert torch.allclose(fq @ fk.transpose(-1, -2), literal_kernel(kernel, q, k, scale), rtol=1e-12, atol=1e-12)
    assert torch.allclose(pairwise(kernel, q, k, scale), literal_kernel(kernel, q, k, scale), rtol=1e-12, atol=0)
    assert (pairwise(kernel, q, k, scale) >= 0).all()


@pytest.mark.parametrize("kernel", ["poly2", "elu"])
def test_the_dense_reference_takes_the_kernel(kernel) -> None:
    q, k, v = qkv()
    valid = torch.rand(B, N, generator=torch.Generator().manual_seed(6)) > 0.25
    mask = causal_mask(N, 7)
    scale = None if kernel == "elu" else 0.3
    got = reference_attention(Inputs.of(q, k, v, scale=scale, key_padding_mask=valid), mask[0, 0], kernel=kernel)
    want = quadratic(kernel, q, k, v, mask & valid[:, None, None, :], 1.0 if scale is None else scale)
    assert (got - want).abs().max() <= 1e-13
    step = attend_cached_kernel(q[:, :, -1], k, v, kernel, 1.0 if scale is None else scale, allowed=valid[:, None])
    assert (step - quadratic(kernel, q, k, v, causal_mask(N, None, True, valid),
                             1.0 if scale is None else scale)[:, :, -1]).abs().max() <= 1e-13
    with pytest.raises(ValueError, match="relative positions are defined for the exponential kernel only"):
        reference_attention(Inputs.of(q, k, v), mask[0, 0], rel=RelativePositions(D, 4).double(), kernel=kernel)


@pytest.mark.parametrize("kernel", ["poly2", "elu"])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 5), (False, 4)])
def test_kernel_attention_is_the_quadratic_definition(kernel, causal, window) -> None:
    q, k, v = qkv()
    valid = torch.rand(B, N, generator=torch.Generator().manual_seed(3)) > 0.25
    scale = None if kernel == "elu" else D ** -0.5
    mask = causal_mask(N, window, causal, valid)
    assert_close_with_grads(
        lambda q, k, v: kernel_attention(Inputs.of(q, k, v, scale=scale, key_padding_mask=valid), kernel,
                                         causal=causal, window=window, block=8),
        lambda q, k, v: quadratic(kernel, q, k, v, mask, 1.0 if scale is None else scale), q, k, v)


def test_full_and_local_take_the_kernel() -> None:
    q, k, v = qkv()
    x = Inputs.of(q, k, v)
    assert torch.equal(full_attention(x, KernelOptions(kernel="poly2")), kernel_attention(x, "poly2"))
    assert torch.equal(local_attention(x, LocalOptions(5, kernel="elu")), kernel_attention(x, "elu", window=5))
    assert torch.equal(full_attention(x, KernelOptions(kernel="exp")), full_attention(x))


# --- linear attention -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["poly2", "elu"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_linear_attention_equals_the_quadratic_definition(kernel, causal, chunk) -> None:
    q, k, v = qkv()
    valid = torch.rand(B, N, generator=torch.Generator().manual_seed(4)) > 0.3
    mask = causal_mask(N, None, causal, valid)
    scale = 1.0 if kernel == "elu" else D ** -0.5
    assert_close_with_grads(
        lambda q, k, v: linear_attention(Inputs.of(q, k, v, key_padding_mask=valid), LinearOptions(kernel=kernel),
                                         causal=causal, chunk=chunk),
        lambda q, k, v: quadratic(kernel, q, k, v, mask, scale), q, k, v, tol=1e-11)


@pytest.mark.parametrize("attend", [
    lambda q, k, v: linear_attention(Inputs.of(q, k, v), LinearOptions(kernel="elu"), chunk=8),
    lambda q, k, v: linear_attention(Inputs.of(q, k, v), LinearOptions(kernel="poly2"), chunk=8),
    lambda q, k, v: performer_attention(Inputs.of(q, k, v), PerformerOptions(features=16),
                                        generator=torch.Generator().manual_seed(0), chunk=8),
    lambda q, k, v: kernel_attention(Inputs.of(q, k, v), "poly2", window=6, block=8),
], ids=["linear-elu", "linear-poly2", "performer", "local-poly2"])
def test_no_leak_from_later_positions(attend) -> None:
    q, k, v = qkv()
    for t in (0, 9, 20, N - 2):  # the future replaced by values 10× larger: a global maximum would move
        assert not leaks(attend, q, k, v, t), t


def test_linear_attention_in_float32_and_half_precision() -> None:
    q, k, v = qkv()
    want = linear_attention(Inputs.of(q, k, v), LinearOptions(kernel="elu"), chunk=8)
    got32 = linear_attention(Inputs.of(q.float(), k.float(), v.float()), LinearOptions(kernel="elu"), chunk=8)
    assert (got32.double() - want).abs().max() < 1e-5
    for dtype in (torch.float16, torch.bfloat16):
        big = [x.to(dtype) * 8 for x in (q, k, v)]  # (1 + q·k/√D)² summed over keys overflows fp16 if computed there
        out = linear_attention(Inputs.of(*big), LinearOptions("poly2"), chunk=8)
        assert out.dtype == dtype and torch.isfinite(out).all()
        ref = linear_attention(Inputs.of(*(x.double() for x in big)), LinearOptions("poly2"), chunk=8)
        assert (out.double() - ref).abs().max() / ref.abs().max() < 2e-2


def test_linear_decoding_state_is_flat_and_reproduces_the_forward() -> None:
    q, k, v = qkv()
    state = LinearState.empty(B, H, D, D, device="cpu", dtype=torch.float64)
    def phi(x):
        return F.elu(x) + 1
    shapes = set()
    outs = []
    for t in range(N):
        state.add(phi(k[:, :, t:t + 1]), v[:, :, t:t + 1])
        outs.append(state.read(phi(q[:, :, t:t + 1])))
        shapes.add((tuple(state.kv.shape), tuple(state.norm.shape)))
    assert shapes == {((B, H, D, D), (B, H, D))}  # the same size at every position
    assert (torch.cat(outs, 2) - linear_attention(Inputs.of(q, k, v), LinearOptions(kernel="elu"),
                                                  chunk=8)).abs().max() < 1e-12


# --- Performer --------------------------------------------------------------------------------------------------

def test_orthogonal_features_are_orthogonal_in_blocks_with_gaussian_norms() -> None:
    w = orthogonal_features(2, 20, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert w.shape == (2, 20, 8)
    block = w[:, :8] / w[:, :8].norm(dim=-1, keepdim=True)
    assert torch.allclose(block @ block.transpose(-1, -2), torch.eye(8, dtype=torch.float64).expand(2, 8, 8),
                          atol=1e-12)
    rows = orthogonal_features(1, 4000, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    norms = rows.norm(dim=-1)
    assert abs(norms.square().mean().item() - 8) < 0.5  # E|w|² = D, as for a Gaussian row


def test_performer_chunks_equal_its_quadratic_form() -> None:
    q, k, v = qkv()
    w = orthogonal_features(H, 16, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    valid = torch.rand(B, N, generator=torch.Generator().manual_seed(5)) > 0.3

    def quadratic_form(q, k, v):
        weights = performer_features(q, w, D ** -0.5, query=True) @ performer_features(k, w, D ** -0.5,
                                                                                       query=False).transpose(-1, -2)
        weights = weights * causal_mask(N, None, True, valid)
        return (weights @ v) / weights.sum(-1, keepdim=True).clamp_min(1e-300)

    assert_close_with_grads(lambda q, k, v: performer_attention(Inputs.of(q, k, v, key_padding_mask=valid),
                                                                projection=w, chunk=8),
                            quadratic_form, q, k, v, tol=1e-11)


@pytest.mark.parametrize("causal", [True, False])
def test_performer_converges_to_softmax_attention_as_features_grow(causal) -> None:
    q, k, v = qkv(n=64, d=8, spread=0.6)
    exact = full_attention(Inputs.of(q, k, v), causal=causal)
    errors = []
    for m in (8, 64, 512, 4096):
        draws = [performer_attention(Inputs.of(q, k, v), PerformerOptions(features=m), causal=causal,
                                     generator=torch.Generator().manual_seed(s))
                 for s in range(4)]
        errors.append(sum(((o - exact).norm() / exact.norm()).item() for o in draws) / len(draws))
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < errors[0] / 4, errors  # ~ 1/√m: 512× the features, well over 4× less error


def test_performer_ignores_padded_keys_and_stays_finite_in_half_precision() -> None:
    q, k, v = qkv()
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[:, 5::4] = False
    w = orthogonal_features(H, 16, D, generator=torch.Generator().manual_seed(2))
    out = performer_attention(Inputs.of(q, k, v, key_padding_mask=valid), projection=w)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5::4], v2[:, :, 5::4] = 1e3, 1e3
    assert torch.equal(out, performer_attention(Inputs.of(q, k2, v2, key_padding_mask=valid), projection=w))
    for dtype in (torch.float16, torch.bfloat16):
        half = performer_attention(Inputs.of(*(x.to(dtype) * 6 for x in (q, k, v))), projection=w)
        assert half.dtype == dtype and torch.isfinite(half).all()


def tiny_model(**kw) -> TransformerLM:
    cfg = TransformerConfig(vocab_size=32, dim=16, heads=2, depth=2, seq_len=24, positions="absolute", **kw)
    return TransformerLM(cfg)


def test_performer_heads_redraw_deterministically_on_schedule_and_reload() -> None:
    model = tiny_model(attention="performer", options={"performer": {"features": 8, "redraw_every": 2}})
    heads = [g for g in model.head_groups()]
    first = [h.projection.clone() for h in heads]
    assert not torch.equal(first[0], first[1])  # each layer its own features
    model.after_optimizer_step(1)
    assert all(torch.equal(h.projection, p) for h, p in zip(heads, first, strict=True))
    model.after_optimizer_step(2)
    assert all(not torch.equal(h.projection, p) for h, p in zip(heads, first, strict=True))
    twin = tiny_model(attention="performer", options={"performer": {"features": 8, "redraw_every": 2}})
    twin.after_optimizer_step(2)  # the same seed and count: the same draw (every rank agrees without a broadcast)
    assert all(torch.equal(a.projection, b.projection) for a, b in zip(heads, twin.head_groups(), strict=True))
    fresh = tiny_model(attention="performer", options={"performer": {"features": 8, "redraw_every": 2}})
    fresh.load_state_dict(model.state_dict())
    assert all(torch.equal(a.projection, b.projection) and int(a.draws) == 1
               for a, b in zip(fresh.head_groups(), heads, strict=True))


# --- configs and errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    ({"attention": "full", "options": {"full": {"kernel": "cos"}}},
     "kernel must be one of 'exp', 'poly2', 'elu', got 'cos'"),
    ({"attention": "full", "options": {"full": {"kernel": "elu"}}, "positions": "relative"},
     "full heads do not support relative"),
    ({"attention": "linear", "options": {"linear": {"kernel": "exp"}}},
     "options.linear: kernel='exp': linear heads need kernel='elu' or 'poly2'"),
    ({"attention": "linear", "options": {"linear": {"features": 3}}},
     "options.linear: features .3. follows from the kernel and head_dim"),
    ({"attention": "performer", "options": {"performer": {"features": 0}}},
     "options.performer: features must be a positive integer"),
    ({"attention": "performer", "options": {"performer": {"redraw_every": -1}}},
     "options.performer: redraw_every must be a non-negative integer"),
])
def test_config_errors_name_the_field(kw, message) -> None:
    kw = {"positions": "absolute", **kw}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TransformerConfig(vocab_size=32, dim=16, heads=2, depth=1, seq_len=24, rel_clip=8, **kw)


def test_the_kernel_is_each_kinds_own_option() -> None:
    # a kernel for the local heads leaves the routing heads beside them as they are (it once had to be 'exp' for
    # every kind in the model: one field for all); linear heads default to elu
    c = TransformerConfig(vocab_size=32, dim=16, heads=2, depth=1, seq_len=24, attention="local:1,routing:1",
                          positions="absolute", options={"local": {"kernel": "elu", "window": 8}})
    assert c.options["local"].kernel == "elu" and c.describe_heads().startswith("local: window=8, kernel=elu")
    model = TransformerLM(c)
    assert [g.kernel for g in model.head_groups()[:1]] == ["elu"]
    assert TransformerConfig(attention="linear", positions="none").options["linear"].kernel == "elu"


def test_function_errors_are_one_line() -> None:
    q, k, v = qkv()
    cases = [
        (lambda: full_attention(Inputs.of(q, k, v), KernelOptions(kernel="rbf")), "kernel must be one of"),
        (lambda: linear_attention(Inputs.of(q, k, v), LinearOptions(kernel="exp")),
         "kernel='exp': linear heads need kernel='elu' or 'poly2'"),
        (lambda: linear_attention(Inputs.of(q, k, v, scale=0.5), LinearOptions(kernel="elu")),
         "elu kernel .* has no scale"),
        (lambda: linear_attention(Inputs.of(q, k, v), chunk=0), "chunk must be a positive integer"),
        (lambda: performer_attention(Inputs.of(q, k, v), projection=torch.randn(H, 4, D + 1)),
         "projection must have shape"),
        (lambda: performer_attention(Inputs.of(q, k, v), PerformerOptions(features=-3)),
         "features must be a positive integer"),
        (lambda: kernel_attention(Inputs.of(q, k, v), "exp"), "kernel must be one of 'poly2', 'elu'"),
        (lambda: linear_attention(Inputs.of(q, k[:, :, :5], v)), "same shape"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("attend", [
    lambda q, k, v: linear_attention(Inputs.of(q, k, v), LinearOptions(kernel="elu"), chunk=8),
    lambda q, k, v: linear_attention(Inputs.of(q, k, v), LinearOptions(kernel="poly2"), chunk=8),
    lambda q, k, v: performer_attention(Inputs.of(q, k, v), projection=torch.ones(H, 8, D), chunk=8),
    lambda q, k, v: kernel_attention(Inputs.of(q, k, v), "elu", block=16),
], ids=["linear-elu", "linear-poly2", "performer", "kernel-elu"])
def test_no_graph_breaks_under_compile(attend) -> None:
    q, k, v = qkv(dtype=torch.float32)
    explanation = torch._dynamo.explain(attend)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_models_with_the_new_kinds_train_and_count_their_cost() -> None:
    model = tiny_model(attention="local:1,linear:1", rel_clip=8,
                       options={"local": {"kernel": "poly2", "window": 8}, "linear": {"kernel": "poly2"}})
    x = torch.randint(0, 32, (2, 24))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    assert math.isfinite(loss.item())
    costs = model.config.keys_per_query()
    assert costs["local"] == 8 and costs["linear"] > feature_dim("elu", 8)
