"""LSH attention: exact against the dense reference over the union of the rounds' windows (a key shared by rounds
counted once), leak-free, the own-key and padding rules, precision, the 'lsh' head kind (generic checks, options,
flat decoding cache, rotations in the state dict) and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import leaks, rand_padding, rand_qkv
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import Inputs, LSHOptions, get_kind, lsh_attention, reference_attention
from routeformer.attention import lsh as lsh_kind
from routeformer.attention.lsh import lsh_hash, lsh_mask, lsh_rotations
from routeformer.attention.routing.sorted_window import sorted_window_mask
from routeformer.testing import check_kind


def lsh(q, v, *, key_padding_mask=None, scale=None, causal=True, rotations=None, seed=0, backend="auto", **options):
    """lsh_attention on (q as the keys, v) with the keyword arguments ``lsh_mask`` takes (the options' fields loose)."""
    return lsh_attention(Inputs.of(q, q, v, scale=scale, key_padding_mask=key_padding_mask), LSHOptions(**options),
                         backend, causal=causal, rotations=rotations, seed=seed)

B, H, D = 2, 2, 8


def _reference(q, v, mask, scale=None):
    return reference_attention(Inputs.of(q, F.normalize(q, dim=-1), v, scale=scale), mask)


def _rounds_holding(q, *, buckets, rounds, window, causal, rotations=None, seed=0):
    """c_ij (B, H, N, N): how many rounds' windows hold key j for query i (own key and padding not removed)."""
    rotations = lsh_rotations(q.shape[1], q.shape[3], buckets, rounds, seed=seed) if rotations is None else rotations
    hashes = lsh_hash(q, rotations)
    return sum(sorted_window_mask(hashes[:, :, r], window, causal, exclude_self=False).long()
               for r in range(rounds))


@pytest.mark.parametrize("backend", ["fused", "tiles", "flex"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N, buckets, rounds, window, padded", [
    (37, 4, 3, 5, False),
    (37, 4, 3, 5, True),
    (24, 2, 2, 30, True),  # window past N: every earlier position of the bucket
    (29, 6, 4, 3, False),
])
def test_matches_the_reference_over_the_union_of_rounds_counting_shared_keys_once(
        causal: bool, N: int, buckets: int, rounds: int, window: int, padded: bool, backend: str) -> None:
    q, _, v = rand_qkv(B, H, N, D, seed=N + rounds)
    padding = rand_padding(B, N) if padded else None
    kw = {"buckets": buckets, "rounds": rounds, "window": window, "causal": causal, "key_padding_mask": padding}
    mask = lsh_mask(q, **kw)
    out = lsh(q, v, **kw, backend=backend)
    ref = _reference(q, v, mask)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, v], grad), torch.autograd.grad(ref, [q, v], grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    # Keys really are shared by several rounds here, and counting them once per round would be visibly different.
    count = _rounds_holding(q, buckets=buckets, rounds=rounds, window=window, causal=causal) * mask
    assert (count >= 2).any() and (count == 1).any()
    with torch.no_grad():
        scores = q @ F.normalize(q, dim=-1).transpose(-1, -2) * D**-0.5
        weights = count * (scores - scores.amax(-1, keepdim=True)).exp()
        twice = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300) @ v
    assert (out.detach() - twice).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["fused", "tiles"])
def test_gradcheck_on_a_tiny_problem(backend: str) -> None:
    q, _, v = rand_qkv(1, 1, 9, 4, seed=3)
    rot = lsh_rotations(1, 4, 2, 2, seed=1)
    assert torch.autograd.gradcheck(lambda q_, v_: lsh_attention(Inputs.of(q_, q_, v_), LSHOptions(2, 2, 3), backend,
                                                                 rotations=rot), (q, v))


@pytest.mark.parametrize("backend", ["fused", "tiles", "flex"])
@pytest.mark.parametrize("padded", [False, True])
def test_no_causal_leak(padded: bool, backend: str) -> None:
    N = 40
    q, _, v = rand_qkv(B, H, N, D, seed=5, grad=False)
    padding = rand_padding(B, N, seed=2) if padded else None
    rot = lsh_rotations(H, D, 4, 3, seed=2)

    def attend(q_, k_, v_):  # k is ignored: the keys are the normalised queries
        return lsh_attention(Inputs.of(q_, q_, v_, key_padding_mask=padding), LSHOptions(4, 3, 4), backend,
                             rotations=rot)

    for t in (0, 7, 19, 33):
        assert not leaks(attend, q, q, v, t, atol=1e-12)
    # The non-causal rule does see the future: the check has teeth.
    assert leaks(lambda q_, k_, v_: lsh_attention(Inputs.of(q_, q_, v_), LSHOptions(buckets=4, rounds=3, window=4),
                                                  causal=False, rotations=rot), q, q, v, 10, atol=1e-6)


def test_own_key_only_when_nothing_else_is_visible() -> None:
    N = 30
    q, _, v = rand_qkv(B, H, N, D, seed=7, grad=False)
    kw = {"buckets": 6, "rounds": 2, "window": 3}
    mask = lsh_mask(q, **kw)
    diag = mask.diagonal(dim1=-2, dim2=-1)
    others = (mask & ~torch.eye(N, dtype=torch.bool)).any(-1)
    assert torch.equal(diag, ~others)  # self exactly when alone
    assert diag.any() and (~diag).any() and diag[..., 0].all()  # position 0 is always alone
    out = lsh(q, v, **kw)
    torch.testing.assert_close(out[diag], v[diag], rtol=0, atol=1e-15)  # softmax over the one self key
    # window=1 keeps only the own key in every round: the output is v.
    torch.testing.assert_close(lsh_attention(Inputs.of(q, q, v), LSHOptions(buckets=4, rounds=3, window=1)), v, rtol=0,
                               atol=1e-15)


def test_padded_keys_are_never_attended() -> None:
    N = 32
    q, _, v = rand_qkv(B, H, N, D, seed=8, grad=False)
    padding = rand_padding(B, N, seed=4)
    kw = {"buckets": 4, "rounds": 2, "window": 6, "key_padding_mask": padding}
    mask = lsh_mask(q, **kw)
    assert not (mask & ~padding[:, None, None, :]).any()
    out = lsh(q, v, **kw)
    assert torch.equal(out[~mask.any(-1)], torch.zeros_like(out[~mask.any(-1)]))  # nothing visible: zeros
    changed = torch.where(padding[:, None, :, None], v, 100 * torch.randn_like(v))  # new values at padded keys
    torch.testing.assert_close(lsh(q, changed, **kw), out, rtol=0, atol=1e-13)


def test_float32_close_to_float64_and_bfloat16_finite() -> None:
    N = 48
    q, _, v = rand_qkv(B, H, N, D, seed=9, dtype=torch.float32, grad=False)
    rot = lsh_rotations(H, D, 6, 2, seed=3)
    kw = {"buckets": 6, "rounds": 2, "window": 5, "rotations": rot}
    assert torch.equal(lsh_hash(q, rot), lsh_hash(q.double(), rot))  # the same buckets
    out = lsh(q, v, **kw)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), lsh(q.double(), v.double(), **kw), rtol=1e-5, atol=1e-5)
    qb, vb = q.bfloat16().requires_grad_(), v.bfloat16().requires_grad_()
    outb = lsh(qb, vb, **kw)
    outb.float().square().sum().backward()
    assert outb.dtype == torch.bfloat16 and torch.isfinite(outb).all()
    assert torch.isfinite(qb.grad).all() and torch.isfinite(vb.grad).all()


def test_hash_buckets_and_rotations() -> None:
    q = rand_qkv(B, H, 20, D, grad=False)[0]
    rot = lsh_rotations(H, D, 6, 3, seed=4)
    assert rot.shape == (H, 3, D, 3) and torch.equal(rot, lsh_rotations(H, D, 6, 3, seed=4))
    assert not torch.equal(rot, lsh_rotations(H, D, 6, 3, seed=5))
    hashes = lsh_hash(q, rot)
    assert hashes.shape == (B, H, 3, 20) and hashes.min() >= 0 and hashes.max() < 6
    assert torch.equal(hashes, lsh_hash(3 * q, rot))  # angular: the scale does not matter
    # rotations=None draws them from the seed.
    kw = {"buckets": 6, "rounds": 3, "window": 4}
    assert torch.equal(lsh(q, q, **kw, seed=4), lsh(q, q, **kw, rotations=rot))


@pytest.mark.parametrize("kwargs, message", [
    ({"buckets": 5}, "buckets must be even"),
    ({"buckets": 0}, "buckets must be a positive integer"),
    ({"rounds": 0}, "rounds must be a positive integer"),
    ({"window": 0}, "window must be a positive integer"),
    ({"window": 2.5}, "window must be a positive integer"),
    ({"rotations": torch.zeros(H, 2, D, 3)}, r"rotations must have shape \(H, rounds, D, buckets/2\)"),
    ({"key_padding_mask": torch.ones(B, 5, dtype=torch.bool)}, "key_padding_mask must have shape"),
    ({"scale": -1.0}, "scale must be a positive"),
])
def test_argument_errors_name_the_argument(kwargs: dict, message: str) -> None:
    q = torch.randn(B, H, 10, D)
    args = {"buckets": 4, "rounds": 2, "window": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        lsh(q, q, **args)
    with pytest.raises(ValueError, match="shares queries and keys"):  # the keys are the queries: k must be q
        lsh_attention(Inputs.of(q, q.clone(), q), LSHOptions(buckets=4, rounds=2, window=3))
    with pytest.raises(ValueError, match="q, k and v must have the same shape"):
        lsh_attention(Inputs.of(q, q, q[:, :, :5]), LSHOptions(buckets=4, rounds=2, window=3))


def test_the_kind_passes_the_generic_checks() -> None:
    report = check_kind("lsh", seq_len=40, positions="absolute",
                        options={"lsh": {"buckets": 4, "rounds": 3, "window": 6}})
    assert max(report.reference, report.reference_grad, report.leak, report.decode) <= 1e-9


def test_config_defaults_and_errors_name_the_field() -> None:
    def options(seq_len: int, options: dict | None = None):
        config = TransformerConfig(heads=2, dim=16, attention="local:1,lsh:1", positions="absolute", rel_clip=8,
                                   seq_len=seq_len, options={"local": {"window": 8}, **(options or {})})
        return config.head_groups()[0][1].options, config

    o, config = options(seq_len=30)  # round(sqrt(30)) = 5 -> 6 buckets, window 30 // 6
    assert (o.buckets, o.rounds, o.window) == (6, 2, 5)
    assert config.keys_per_query()["lsh"] == 2 * 5 + 2 * 3
    given = {"buckets": 4, "rounds": 3, "window": 7}
    assert options(seq_len=64, options={"lsh": given})[0] == lsh_kind.LSHOptions(4, 3, 7)
    for field, value, message in [("buckets", 5, "options.lsh: buckets must be even"),
                                  ("buckets", 0, "options.lsh: buckets must be a positive integer"),
                                  ("rounds", 0, "options.lsh: rounds must be a positive integer"),
                                  ("window", 0, "options.lsh: window must be a positive integer"),
                                  ("window", 65, r"options.lsh: window \(65\) is larger than seq_len \(64\)")]:
        with pytest.raises(ValueError, match=message):
            options(seq_len=64, options={"lsh": {field: value}})
    with pytest.raises(ValueError, match="lsh heads do not support relative positions"):
        TransformerConfig(heads=2, dim=16, seq_len=32, attention="lsh")
    assert get_kind("lsh").heads_share_qk(o)


def _lsh_model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=32, dim=16, depth=1, heads=2, seq_len=64, attention="lsh",
                               positions="absolute", options={"lsh": {"buckets": 4, "rounds": 2, "window": 5}})
    return TransformerLM(config).double().eval()


@torch.no_grad()
def test_decoding_cost_is_flat(monkeypatch) -> None:
    model = _lsh_model()
    tokens = torch.randint(0, 32, (1, 60), generator=torch.Generator().manual_seed(0))
    seen = []
    attend = lsh_kind.attend_cached
    monkeypatch.setattr(lsh_kind, "attend_cached", lambda q, cached, *a, **kw: seen.append(cached.keys.shape[2])
                        or attend(q, cached, *a, **kw))
    cache = model.new_cache(1, 60)
    (group_cache,) = cache.layers[0].groups
    sizes = [t.numel() for t in (group_cache.rings.keys, group_cache.rings.values, group_cache.rings.positions)]
    parts = [model(tokens[:, :4], cache)] + [model(tokens[:, i:i + 1], cache) for i in range(4, 60)]
    assert sizes == [t.numel() for t in (group_cache.rings.keys, group_cache.rings.values,
                                         group_cache.rings.positions)]
    assert sizes[0] == 1 * 2 * 2 * 4 * 5 * 8  # B · H · rounds · buckets · window · D, whatever the length
    assert set(seen) == {2 * 5}  # every step scores rounds · window slots
    torch.testing.assert_close(torch.cat(parts, 1), model(tokens), rtol=1e-10, atol=1e-10)
    big = model.new_cache(1, 10_000).layers[0].groups[0].rings.keys
    assert big.numel() == sizes[0]


def test_rotations_are_a_persistent_buffer_fixed_by_the_seed() -> None:
    model = _lsh_model()
    state = model.state_dict()
    names = [k for k in state if k.endswith("rotations")]
    assert names and state[names[0]].shape == (2, 2, 8, 2)
    other = _lsh_model(seed=1)  # other weights, the same layer seeds: the same rotations
    assert torch.equal(other.state_dict()[names[0]], state[names[0]])
    with torch.no_grad():
        state[names[0]].normal_()
    other.load_state_dict(state)
    assert torch.equal(other.state_dict()[names[0]], state[names[0]])


def test_compiles_without_graph_breaks() -> None:
    """With the rotations given, one graph (fullgraph=True), forward and backward; inductor also compiles it
    (checked by hand: slow here). rotations=None creates a torch.Generator, which dynamo cannot trace: one break."""
    q, _, v = rand_qkv(1, 2, 24, 8, dtype=torch.float32, seed=11)
    rot = lsh_rotations(2, 8, 4, 2)

    def attend(a, b):
        return lsh_attention(Inputs.of(a, a, b), LSHOptions(buckets=4, rounds=2, window=5), rotations=rot)

    explained = torch._dynamo.explain(attend)(q, v)
    assert explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    out = compiled(q, v)
    ref = attend(q, v)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), q)[0], torch.autograd.grad(ref.sum(), q)[0],
                               rtol=1e-5, atol=1e-5)
