"""routeformer.analysis and ``routeformer analyze``: substitution of every head by approximations of attention (the
value-aware study), Jensen-Shannon divergence between heads, attention pictures and cluster statistics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import tiny_model_toml, tiny_text_data
from routeformer.analysis import (
    Method,
    PairValues,
    Substitute,
    approximate,
    approximation_table,
    capture,
    hooked,
    methods_for,
    ova_weights,
    project_simplex,
)
from routeformer.analysis.divergence import LN2, head_divergences, js_divergence
from routeformer.analysis.patterns import cluster_stats, head_patterns
from routeformer.cli import main
from routeformer.model import TransformerConfig, TransformerLM
from routeformer.train.distributed import Processes
from routeformer.train.evaluation import Scoring, evaluate

PNG = b"\x89PNG\r\n\x1a\n"
CONFIGS = {
    "local+routing": dict(attention="local:2,routing:2", rel_clip=8,
                          options={"local": {"window": 8}, "routing": {"num_clusters": 3, "window": 6}}),
    "full-poly2": dict(attention="full", options={"full": {"kernel": "poly2"}}, positions="none"),
    "full-elu": dict(attention="full", options={"full": {"kernel": "elu"}}, positions="none"),
    "local+lsh": dict(attention="local:2,lsh:2", rel_clip=8,
                      options={"local": {"window": 8}, "lsh": {"buckets": 4, "window": 6}}, positions="none"),
}


def tiny(name: str = "local+routing", seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=40, dim=32, depth=2, heads=4, seq_len=24, **CONFIGS[name])
    model = TransformerLM(cfg).double().eval()
    for p in model.parameters():  # the zero-initialised output layer would make every loss ln(vocab)
        p.data.add_(torch.randn_like(p) * 0.05)
    return model


def tokens(batch: int = 3, n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 40, (batch, n), generator=torch.Generator().manual_seed(seed))


def substituted_logits(model, x, method: Method) -> torch.Tensor:
    with hooked(model, lambda call, own: approximate(call, method).output), torch.no_grad():
        return model(x)


# --- substitution -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exact_substitution_reproduces_the_model(name) -> None:
    model, x = tiny(name), tokens()
    with torch.no_grad():
        own = model(x)
    torch.testing.assert_close(substituted_logits(model, x, Method("exact")), own, rtol=1e-9, atol=1e-10)


def test_the_exact_row_reproduces_evaluate_and_the_model_comes_back_unchanged() -> None:
    model = tiny().float()
    split = np.random.default_rng(0).integers(0, 40, 24 * 6 + 1)
    own, results = approximation_table(model, split, "bytes", methods_for(["ovo"], [1], True), batch=2,
                                       max_windows=None)
    total, count = evaluate(model, split, Scoring(24, 2), Processes(0, 1, 0, torch.device("cpu")))
    assert own == pytest.approx(total / count / math.log(2), rel=1e-12)
    exact, ovo1 = results
    assert exact.method == Method("exact") and exact.value == pytest.approx(own, rel=1e-5)
    assert exact.relative_error < 1e-5 and ovo1.value > own and ovo1.keys_per_query == pytest.approx(1.0)
    again, _ = evaluate(model, split, Scoring(24, 2), Processes(0, 1, 0, torch.device("cpu")))
    assert again == total  # the hooks are gone


def test_the_first_layers_calls_are_shared_between_methods_and_change_nothing(monkeypatch) -> None:
    """Each method's evaluation meets the first substituted layer with the same inputs: its calls are answered by
    the first method's (``_FirstLayer``), with the very results of computing them afresh."""
    import routeformer.analysis.substitution as substitution

    model = tiny().float()
    split = np.random.default_rng(0).integers(0, 40, 24 * 6 + 1)  # 6 windows: 3 batches of 2
    methods = methods_for(["ovo", "features"], [3], True)
    share, hits = substitution._FirstLayer.share, []

    def counted(self, call):
        kept = share(self, call)
        hits.append(kept is not call)
        return kept

    for layers in (None, [1]):
        hits.clear()
        monkeypatch.setattr(substitution._FirstLayer, "share", counted)
        shared = approximation_table(model, split, "bytes", methods, batch=2, how=Substitute(layers))
        assert sum(hits) == (len(methods) - 1) * 3 * 2  # every method after the first: 3 batches, 2 head groups
        monkeypatch.setattr(substitution._FirstLayer, "share", lambda self, call: call)
        assert approximation_table(model, split, "bytes", methods, batch=2, how=Substitute(layers)) == shared


def test_evaluation_in_batches_of_one_shape_scores_the_same(monkeypatch) -> None:
    """``one_shape`` (on CUDA, where kernels compile per shape): the last, short batch (here 1 window of a
    split's 5, the last of them shorter than seq_len) is padded to the others' shape with rows that score nothing;
    the same sum and count as unpadded batches."""
    model = tiny()
    shapes = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda x, *a, **kw: shapes.append(tuple(x.shape)) or real(x, *a, **kw))
    split = np.random.default_rng(0).integers(0, 40, 24 * 4 + 13)
    procs = Processes(0, 1, 0, torch.device("cpu"))
    plain = evaluate(model, split, Scoring(24, 2), procs)
    assert shapes == [(2, 24), (2, 24), (1, 12)], shapes
    shapes.clear()
    import routeformer.train.evaluation as evaluation

    monkeypatch.setattr(evaluation, "one_shape", lambda device: True)
    fixed = evaluate(model, split, Scoring(24, 2), procs)
    assert shapes == [(2, 24)] * 3, shapes
    assert fixed[1] == plain[1] and fixed[0] == pytest.approx(plain[0], rel=1e-12)


@pytest.mark.parametrize("method", [Method("ovo", 2), Method("ova", 3), Method("sliding", 2), Method("lsh", 2),
                                    Method("features", 16)])
def test_substituted_models_stay_causal(method) -> None:
    model, x = tiny(), tokens(batch=2)
    t = 11
    future = x.clone()
    future[:, t + 1:] = (future[:, t + 1:] + 7) % 40
    a, b = substituted_logits(model, x, method), substituted_logits(model, future, method)
    assert torch.equal(a[:, :t + 1], b[:, :t + 1])
    assert not torch.equal(a[:, t + 1:], b[:, t + 1:])


# --- the values each key offers -----------------------------------------------------------------------------------

def test_pair_values_match_the_literal_tensors() -> None:
    model, x = tiny(), tokens()
    call = capture(model, x)[0]
    values = PairValues(call.v, call.rel_pos)
    N = x.shape[1]
    pos = torch.arange(N)
    _, a_value = call.rel_pos.tables(pos[None, :] - pos[:, None], call.v.dtype)  # (N, N, D)
    literal = call.v[:, :, None, :, :] + a_value  # (B, h, N, N, D): u_ij
    w = torch.rand(*call.v.shape[:3], N, dtype=torch.float64)
    g = torch.randn_like(call.v)
    torch.testing.assert_close(values.combine(w), (w[..., None] * literal).sum(-2))
    torch.testing.assert_close(values.dots(g), (literal * g[:, :, :, None, :]).sum(-1))
    torch.testing.assert_close(values.square_norms(), literal.square().sum(-1))
    keys = torch.randint(0, N, (*call.v.shape[:3], 3))
    expect = torch.gather(literal, 3, keys[..., None].expand(-1, -1, -1, -1, literal.shape[-1]))
    torch.testing.assert_close(values.gather(keys), expect)


# --- the methods --------------------------------------------------------------------------------------------------

def _head(name="local+routing", layer=0, group=0):
    model, x = tiny(name), tokens()
    call = [c for c in capture(model, x) if c.layer == layer][group]
    alpha = call.weights
    values = call.values
    return call, alpha, values, values.combine(alpha)


def _error(values, weights, o):
    return (values.combine(weights) - o).norm(dim=-1)


@pytest.mark.parametrize("group", [0, 1])
def test_optimal_v_aware_1_is_the_nearest_value_by_a_plain_loop(group) -> None:
    call, alpha, values, o = _head(group=group)
    w = ova_weights(alpha, o, values, 1)
    B, h, N, _ = alpha.shape
    pos = torch.arange(N)
    _, a_value = call.rel_pos.tables(pos[None, :] - pos[:, None], call.v.dtype)
    a_value = a_value.detach()
    for b in range(B):
        for head in range(h):
            for i in range(N):
                best, best_j = math.inf, None
                for j in range(N):
                    if alpha[b, head, i, j] > 0:
                        d = float((call.v[b, head, j] + a_value[i, j] - o[b, head, i]).norm())
                        if d < best:
                            best, best_j = d, j
                assert torch.nonzero(w[b, head, i]).flatten().tolist() == [best_j]
                assert float(w[b, head, i, best_j]) == 1.0


def test_optimal_v_aware_is_exact_from_d_plus_1() -> None:
    call, alpha, values, o = _head(name="full-elu")
    D = o.shape[-1]
    w = ova_weights(alpha, o, values, D + 1)
    assert float(_error(values, w, o).max()) < 1e-12
    approx = approximate(call, Method("ova", D + 1))
    assert not approx.upper_bound and int(approx.keys.max()) == D + 1  # Carathéodory's count, not all 24 keys
    assert approximate(call, Method("ova", 3)).upper_bound


@pytest.mark.parametrize("name", ["local+routing", "full-poly2"])
@pytest.mark.parametrize("r", [2, 3, 5])
def test_optimal_v_aware_is_feasible_and_never_worse_than_oblivious_or_aware_1(name, r) -> None:
    call, alpha, values, o = _head(name)
    aware = ova_weights(alpha, o, values, r)
    oblivious = approximate(call, Method("ovo", r)).weights
    single = ova_weights(alpha, o, values, 1)
    assert (aware >= 0).all() and ((aware > 0) <= (alpha > 0)).all()  # only keys the head sees: causal
    torch.testing.assert_close(aware.sum(-1), torch.ones_like(aware.sum(-1)))
    assert int((aware > 0).sum(-1).max()) <= r
    e_aware = _error(values, aware, o)
    assert (e_aware <= _error(values, oblivious, o) + 1e-12).all()
    assert (e_aware <= _error(values, single, o) + 1e-12).all()
    assert (e_aware < _error(values, oblivious, o) - 1e-6).any()  # and it does better somewhere


def test_the_simplex_projection_is_the_nearest_point_of_the_simplex() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 6, generator=gen, dtype=torch.float64) * 2
    p = project_simplex(x)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(50, dtype=torch.float64))
    others = torch.distributions.Dirichlet(torch.ones(6, dtype=torch.float64)).sample((50, 400))
    assert ((x - p).norm(dim=-1)[:, None] <= (x[:, None] - others).norm(dim=-1) + 1e-12).all()


def test_the_projection_of_columns_from_any_threshold_is_the_sorted_projection() -> None:
    """The fits project with Newton's method on the threshold, warm-started from the last iteration's: from any
    start (below, above, or beyond every entry) it lands on ``project_simplex``'s point, ties and one-entry
    columns included."""
    from routeformer.analysis.approximate import _project_columns

    gen = torch.Generator().manual_seed(0)
    for t in (1, 2, 5, 16):
        x = torch.randn(t, 300, generator=gen, dtype=torch.float64) * torch.rand(300, generator=gen,
                                                                                 dtype=torch.float64) * 4
        x[:, :20] = 0.5  # ties
        expect = project_simplex(x.T).T
        for guess in (torch.full((300,), -math.inf, dtype=torch.float64), torch.randn(300, generator=gen,
                      dtype=torch.float64) * 3, x.amax(0) + 1):
            p, theta = _project_columns(x, guess.clone())
            torch.testing.assert_close(p, expect, rtol=0, atol=1e-12)
            torch.testing.assert_close(p, (x - theta).clamp_min(0))


def _literal_fit(u, o, start, iterations, valid):
    """The refit as first written: rows first, a sort per projection (``project_simplex``), ``where`` per step."""
    gram = u @ u.transpose(-1, -2)
    linear = (u @ o[..., None])[..., 0]
    lipschitz = gram.abs().sum(-1).amax(-1, keepdim=True).clamp_min(1e-12)
    excluded = torch.finfo(start.dtype).min / (4 * start.shape[-1])
    w = best = start
    best_value = ((gram @ w[..., None])[..., 0] * w).sum(-1) - 2 * (linear * w).sum(-1)
    for _ in range(iterations):
        step = w - ((gram @ w[..., None])[..., 0] - linear) / lipschitz
        w = project_simplex(step.masked_fill(~valid, excluded)) * valid
        value = ((gram @ w[..., None])[..., 0] * w).sum(-1) - 2 * (linear * w).sum(-1)
        best = torch.where((value < best_value)[..., None], w, best)
        best_value = torch.minimum(value, best_value)
    return torch.where(valid.any(-1, keepdim=True), best, start)


def test_the_refits_follow_the_literal_projected_gradient() -> None:
    """``_simplex_fit`` (rows last, Newton projections) against the literal loop in float64: the same iterates up
    to rounding (late iterates whose objectives tie within rounding may swap as the best, hence 1e-7), the same
    distance to o; excluded entries stay 0 and rows with nothing to fit keep their start."""
    from routeformer.analysis.approximate import _simplex_fit

    gen = torch.Generator().manual_seed(1)
    R, t, D = 300, 6, 8
    u = torch.randn(R, t, D, generator=gen, dtype=torch.float64)
    o = torch.randn(R, D, generator=gen, dtype=torch.float64) * 0.3 + u[:, 0] * 0.5
    valid = torch.rand(R, t, generator=gen) > 0.3
    valid[:10] = False
    start = (valid / valid.sum(-1, keepdim=True).clamp_min(1)).double()
    w = _simplex_fit(u, o, start, 60, valid=valid)
    assert torch.equal(w[:10], start[:10]) and (w[~valid] == 0).all() and (w >= 0).all()
    torch.testing.assert_close(w[10:].sum(-1), torch.ones(R - 10, dtype=torch.float64))
    literal = _literal_fit(u, o, start, 60, valid)
    torch.testing.assert_close(w, literal, rtol=0, atol=1e-7)

    def error(w):
        return ((w[..., None] * u).sum(-2) - o).norm(dim=-1)

    torch.testing.assert_close(error(w), error(literal), rtol=1e-12, atol=0)


def test_optimal_v_aware_keeps_alpha_on_rows_that_see_at_most_r_keys() -> None:
    """Those rows are not fitted (α is feasible, so exact): bit for bit α, and the fitted rows are the same as when
    every row is fitted."""
    call, alpha, values, o = _head()
    count = call.allowed.sum(-1)
    for r in (2, 4, 6):
        w = ova_weights(alpha, o, values, r, allowed=call.allowed)
        few = count <= r
        assert few.any() and (~few).any()
        assert torch.equal(w[few], alpha[few])
        assert int((w > 0).sum(-1).max()) <= r


def test_oblivious_sliding_and_lsh_keep_the_keys_they_say() -> None:
    call, alpha, values, o = _head(name="full-elu")
    ovo = approximate(call, Method("ovo", 3)).weights
    sliding = approximate(call, Method("sliding", 3)).weights
    lsh = approximate(call, Method("lsh", 2)).weights
    N = alpha.shape[-1]
    for w in (ovo, sliding, lsh):
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
        assert ((w > 0) <= (alpha > 0)).all()
    for i in range(N):
        keep = alpha[..., i, :].topk(min(3, i + 1), dim=-1).indices
        assert ((ovo[..., i, :] > 0) == torch.zeros_like(ovo[..., i, :], dtype=torch.bool).scatter(-1, keep,
                                                                                                  True)).all()
        window = torch.zeros(N, dtype=torch.bool)
        window[max(0, i - 2):i + 1] = True
        assert ((sliding[..., i, :] > 0) == window).all()
    # renormalised, not reweighted: kept keys keep their ratios
    torch.testing.assert_close(sliding[..., 5, 4] / sliding[..., 5, 5], alpha[..., 5, 4] / alpha[..., 5, 5])
    assert int((lsh > 0).sum(-1).max()) <= 2


def test_kept_keys_keep_their_weight_when_full_attention_underflows() -> None:
    import dataclasses

    call = capture(tiny("local+routing"), tokens())[0]  # local heads, exponential kernel
    sharp = dataclasses.replace(call, q=call.q * 1e4)  # softmax underflows to exact zeros beside the largest key
    assert int((sharp.weights == 0).sum()) > 0
    for method in (Method("sliding", 1), Method("sliding", 3), Method("lsh", 2)):
        approx = approximate(sharp, method)
        assert (approx.keys >= 1).all(), method  # every query keeps at least its most recent key
        torch.testing.assert_close(approx.weights.sum(-1), torch.ones_like(approx.weights.sum(-1)))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weights_from_the_shared_scores_are_the_reference_weights_bit_for_bit(name) -> None:
    """A call computes its scores once and normalises them under each mask (``restricted``): the same bits as the
    group's own ``reference_weights`` under that mask, for every kind and kernel."""
    from routeformer.analysis.approximate import last_r

    for call in capture(tiny(name), tokens()):
        for keep in (call.allowed, last_r(call.allowed, 3), call.allowed & (torch.rand_like(call.q[..., :1]) > 0.5)):
            own = call.group.reference_weights(call.q, call.k, call.rel_pos, mask=keep)
            assert torch.equal(call.restricted(keep), own), (name, call.layer, call.kind)
        assert torch.equal(call.weights, call.group.reference_weights(call.q, call.k, call.rel_pos))


@pytest.mark.parametrize("name", ["local+routing", "local+lsh"])
def test_random_features_approach_the_exact_weights_as_features_grow(name) -> None:
    model, x = tiny(name), tokens()
    for call in capture(model, x)[:2]:  # local, and routing / LSH (whose keys are the unit queries)
        alpha = call.weights
        errors = [float((approximate(call, Method("features", m)).weights - alpha).abs().sum(-1).mean())
                  for m in (4, 4096)]
        assert errors[1] < 0.25 * errors[0], call.kind
    with pytest.raises(ValueError, match="exponential kernel only"):
        approximate(capture(tiny("full-elu"), x)[0], Method("features", 8))


@pytest.mark.parametrize("clip", [3, 40])
def test_relative_feature_scores_are_the_features_of_every_pairs_key(clip) -> None:
    """The diagonals-and-corners computation against φ(q_i) · φ(k_j + a^K_ij) with each pair's key built, in
    float64, with both corners (clip 3 < N) and none (clip 40 >= N); with ``seen`` only the wanted pairs."""
    from routeformer.analysis.approximate import relative_feature_scores
    from routeformer.attention.performer import orthogonal_features, performer_features
    from routeformer.executors.relative import RelativePositions

    gen = torch.Generator().manual_seed(2)
    B, h, N, D, m, scale = 2, 3, 17, 8, 5, 0.3
    torch.manual_seed(0)
    rel_pos = RelativePositions(D, clip, init_std=0.5).double()
    q, k = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64) for _ in range(2))
    projection = orthogonal_features(h, m, D, generator=gen, dtype=torch.float64)
    phi_q = performer_features(q, projection, scale, query=True)
    pos = torch.arange(N)
    a_key, _ = rel_pos.tables(pos[None, :] - pos[:, None], torch.float64)  # (N, N, D)
    keys = (k[:, :, None] + a_key.detach()).flatten(2, 3)  # (B, h, N·N, D): each pair's own key
    phi_k = performer_features(keys, projection, scale, query=False).view(B, h, N, N, m)
    literal = torch.einsum("bhim,bhijm->bhij", phi_q, phi_k)
    with torch.no_grad():
        torch.testing.assert_close(relative_feature_scores(phi_q, k, projection, scale, rel_pos), literal,
                                   rtol=1e-12, atol=0)
        seen = torch.rand(N, N, generator=gen) > 0.7
        some = relative_feature_scores(phi_q, k, projection, scale, rel_pos, seen=seen)
    torch.testing.assert_close(some[..., seen], literal[..., seen], rtol=1e-12, atol=0)


def test_methods_refuse_bad_settings() -> None:
    for bad in (dict(name="ovo", r=0), dict(name="ova", r=-2), dict(name="ovo"), dict(name="exact", r=3),
                dict(name="best", r=2)):
        with pytest.raises(ValueError):
            Method(**bad)


# --- heads and patterns -------------------------------------------------------------------------------------------

def test_js_divergence_bounds() -> None:
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.3, 0.7]], dtype=torch.float64)
    assert torch.equal(js_divergence(p, p), torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(js_divergence(p, q), torch.full((2,), LN2, dtype=torch.float64))
    a, b = torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])
    m = (a + b) / 2  # spelled out
    expect = 0.5 * float((a * (a / m).log()).sum()) + 0.5 * float(b[0] * (b[0] / m[0]).log())
    assert float(js_divergence(a, b)) == pytest.approx(expect)


def test_head_divergences_by_kind_pair() -> None:
    model = tiny()
    results = head_divergences(model, [tokens(seed=s) for s in range(3)])
    assert [r.layer for r in results] == [0, 1]
    for r in results:
        assert r.kinds == ["local", "local", "routing", "routing"]
        assert set(r.pairs) == {"local-local", "local-routing", "routing-routing"}
        off_diagonal = ~torch.eye(4, dtype=torch.bool)
        assert (r.mean[off_diagonal] > 0).all() and (r.mean <= LN2).all()
        assert torch.equal(r.mean, r.mean.T) and (r.std > 0).any()
        lr = [float(r.mean[a, b]) for a in (0, 1) for b in (2, 3)]
        assert r.pairs["local-routing"][0] == pytest.approx(sum(lr) / 4, rel=1e-5)


def test_patterns_and_cluster_statistics() -> None:
    model = tiny()
    pats = head_patterns(model, tokens(batch=1)[0], layer=1)
    assert [p.head for p in pats] == [0, 1, 2, 3] and [p.kind for p in pats][2:] == ["routing", "routing"]
    assert pats[0].clusters is None and pats[2].clusters.shape == (24,)
    assert pats[0].weights.shape == (24, 24) and torch.equal(pats[0].weights.triu(1), torch.zeros(24, 24))
    stats = cluster_stats(model, [tokens(seed=s) for s in range(2)])
    assert [(s.layer, s.head) for s in stats] == [(0, 2), (0, 3), (1, 2), (1, 3)]
    for s in stats:
        assert len(s.sizes) == 3 and float(s.sizes.sum()) == pytest.approx(24.0)
        assert (s.sizes[:-1] >= s.sizes[1:]).all() and s.balance >= 1.0 and 0 < s.captured <= 1.0 + 1e-9
    with pytest.raises(ValueError, match="head 7 does not exist"):
        head_patterns(model, tokens(batch=1)[0], layer=0, head=7)


# --- the command --------------------------------------------------------------------------------------------------

TINY = tiny_model_toml(depth=2) + """
[train]
device = "cpu"  # a CPU test, also on a machine with a GPU
data = "tiny"
batch_size = 4
lr = 3e-3
warmup_steps = 2
max_steps = 6
eval_every = 6
eval_tokens = 256
log_every = 2
sample_tokens = 0
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyze")
    tiny_text_data(root, "".join(f"{i}: def route(q, keys): return max(keys, key=q.dot)\n" for i in range(200)))
    (root / "tiny.toml").write_text(TINY)
    run = root / "run"
    assert main(["train", "--config", str(root / "tiny.toml"), "--data-dir", str(root / "data"), "--out",
                 str(run)]) == 0
    return run


def _one_line_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main([*argv, "--device", "cpu"]) == 2  # the run loads on the CPU, also where there is a GPU
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("routeformer: error: ") and "Traceback" not in err
    return err


def test_analyze_writes_tables_and_pictures(run_dir, capsys) -> None:
    capsys.readouterr()
    assert main(["analyze", str(run_dir), "approximations", "--r", "1,2,17", "--windows", "4",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "optimal-v-aware-2 (upper bound)" in out and "random features-17" in out
    assert "optimal-v-aware-17 " in out and "optimal-v-aware-17 (upper bound)" not in out  # D = 16: exact
    own = float(out.split("model's own evaluation on these windows: ")[1].split()[0])
    exact = float(out.split("\nexact")[1].split()[0])
    assert exact == pytest.approx(own, abs=1e-4)
    assert main(["analyze", str(run_dir), "heads", "--batches", "2", "--batch-size", "2", "--device",
                 "cpu"]) == 0
    assert "local-routing" in capsys.readouterr().out
    assert main(["analyze", str(run_dir), "patterns", "--layer", "1", "--text", "def route(q, keys):",
                 "--batches", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    analysis = run_dir / "analysis"
    for name in ("approximations.txt", "approximations.csv", "approximations.png", "heads.txt", "heads.csv",
                 "heads.png", "patterns-layer1.png", "clusters.txt", "clusters.png"):
        assert (analysis / name).is_file(), name
    for name in ("patterns-layer1.png", "clusters.txt", "clusters.png"):
        assert str(analysis / name) in out
    import matplotlib.image

    for name in ("approximations.png", "heads.png", "patterns-layer1.png", "clusters.png"):
        assert (analysis / name).read_bytes().startswith(PNG)
        assert matplotlib.image.imread(analysis / name).ndim == 3


def test_analyze_approximations_shows_a_progress_bar(run_dir, capsys, tmp_path) -> None:
    """One bar over the methods on stderr (as training's and evaluate's); stdout keeps each method's line and the
    table, without the bar."""
    capsys.readouterr()
    assert main(["analyze", str(run_dir), "approximations", "--methods", "ovo,sliding", "--r", "1,2", "--windows",
                 "2", "--out", str(tmp_path), "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    methods = 5  # exact, then ovo and sliding at r = 1 and 2
    assert "approximations" in captured.err and f"0/{methods} [" in captured.err and "method/s" in captured.err
    assert f"/{methods} [" not in captured.out
    assert "  optimal-v-oblivious-2: " in captured.out and "\nsliding-window-2 " in captured.out


def test_analyze_bad_inputs_are_one_line_errors(run_dir, capsys, tmp_path) -> None:
    run = str(run_dir)
    assert "does not exist" in _one_line_error(capsys, ["analyze", str(tmp_path / "nowhere"), "heads"])
    assert "layer 5 does not exist" in _one_line_error(capsys, ["analyze", run, "heads", "--layers", "0,5"])
    assert "no layers given" in _one_line_error(capsys, ["analyze", run, "heads", "--layers", ","])
    assert "layer 3 does not exist" in _one_line_error(capsys, ["analyze", run, "patterns", "--layer", "3"])
    assert "head 2 does not exist" in _one_line_error(capsys, ["analyze", run, "patterns", "--head", "2"])
    for bad in ("0", "2,-1", "x"):
        assert "--r must be comma-separated positive integers" in _one_line_error(
            capsys, ["analyze", run, "approximations", "--r", bad])
    assert "unknown method(s) best" in _one_line_error(capsys, ["analyze", run, "approximations", "--methods",
                                                                "ovo,best"])
    assert "no such file" in _one_line_error(capsys, ["analyze", run, "patterns", "--text-file",
                                                      str(tmp_path / "missing.txt")])


# --- analyze routing ----------------------------------------------------------------------------------------------

def test_routing_use_against_a_direct_computation() -> None:
    """Mass beyond the local window, by distance, and the heaviest far pairs, recomputed from the routing heads'
    weights with plain loops."""
    from routeformer.analysis.routing import routing_use

    model = tiny()
    batches = [tokens(batch=2, seed=s) for s in range(2)]
    use = routing_use(model, batches, local_window=4, top=5, context=2)
    assert use.edges == [0, 4, 8, 16, 24]
    mass, pairs = {}, []
    for x in batches:
        for call in capture(model, x):
            if call.kind != "routing":
                continue
            w = call.group.reference_weights(call.q, call.k, call.rel_pos).detach()
            for r in range(w.shape[0]):
                for i, h in enumerate(call.heads):
                    for q in range(24):
                        for k in range(q + 1):
                            d = q - k
                            bin_ = next(t for t in range(4) if use.edges[t] <= d < use.edges[t + 1])
                            mass.setdefault((call.layer, h), [0.0] * 4)[bin_] += float(w[r, i, q, k]) / (4 * 24)
                            if d >= 4:
                                pairs.append((float(w[r, i, q, k]), call.layer, h,
                                              bool(q >= 1 and k >= 1 and x[r, q - 1:q + 1].tolist()
                                                   == x[r, k - 1:k + 1].tolist())))
    assert sorted(use.mass) == sorted(mass) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    for key, want in mass.items():
        assert use.mass[key] == pytest.approx(want, abs=1e-12)
        assert use.beyond[key] == pytest.approx(sum(want[1:]), abs=1e-12)
        assert sum(use.mass[key]) == pytest.approx(1.0, abs=1e-9)  # every query's weights sum to 1
    pairs.sort(key=lambda p: -p[0])
    assert [p.weight for p in use.top] == pytest.approx([p[0] for p in pairs[:5]], abs=1e-12)
    assert [(p.layer, p.head, p.same_context) for p in use.top] == [p[1:] for p in pairs[:5]]
    assert all(p.query - p.key >= 4 for p in use.top)


def test_routing_use_far_recurring_queries_against_loops() -> None:
    """The mass beyond the local window over only the queries whose last 2 tokens last occurred 4 or more back
    (where a copy must come from beyond the window), recomputed with plain loops on a small alphabet."""
    from routeformer.analysis.routing import routing_use

    model = tiny()
    batches = [tokens(batch=2, seed=s) % 5 for s in range(2)]  # contexts recur, near and far
    use = routing_use(model, batches, local_window=4, top=5, context=2)

    def far(x, r, q) -> bool:
        earlier = [s for s in range(1, q) if x[r, s - 1:s + 1].tolist() == x[r, q - 1:q + 1].tolist()]
        return bool(earlier) and q - earlier[-1] >= 4

    far_mass, far_count = {}, 0
    for x in batches:
        far_count += sum(far(x, r, q) for r in range(x.shape[0]) for q in range(1, 24))
        for call in capture(model, x):
            if call.kind != "routing":
                continue
            w = call.group.reference_weights(call.q, call.k, call.rel_pos).detach()
            for r in range(w.shape[0]):
                for q in range(1, 24):
                    if far(x, r, q):
                        for i, h in enumerate(call.heads):
                            key = (call.layer, h)
                            far_mass[key] = far_mass.get(key, 0.0) + float(w[r, i, q, :q - 3].sum())
    assert use.far_queries == far_count > 0
    assert 0 < far_count < 4 * 24  # some queries recur far, not all: the condition selects
    assert sorted(use.far_beyond) == sorted(far_mass) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    for key, total in far_mass.items():
        assert use.far_beyond[key] == pytest.approx(total / far_count, abs=1e-12)
        assert use.far_beyond[key] != pytest.approx(use.beyond[key], abs=1e-6)  # not the mean over all queries


def test_recurrence_distances_and_loss_by_recurrence_against_loops() -> None:
    from routeformer.analysis.routing import loss_by_recurrence, recurrence_distances

    row = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 9, 1, 2])
    want = []
    for t in range(len(row)):
        prev = [s for s in range(1, t) if row[s - 1:s + 1].tolist() == row[t - 1:t + 1].tolist()] if t >= 1 else []
        want.append(t - prev[-1] if prev else 0)
    assert recurrence_distances(row, 2).tolist() == want == [0, 0, 0, 0, 3, 3, 3, 3, 0, 0, 3]
    model, baseline = tiny(), tiny(name="local+routing", seed=1)
    windows = [tokens(batch=2, n=25, seed=s) % 6 for s in range(2)]  # a small alphabet: contexts recur
    rows = loss_by_recurrence(model, baseline, windows, [0, 4, 8, 24], context=2)
    assert [r.label for r in rows] == ["not in the window", "1-3", "4-7", "8-23"]
    ours, theirs, dists = [], [], []
    for w in windows:
        for m, out in ((model, ours), (baseline, theirs)):
            logits = m(w[:, :-1]).detach()
            out.append(-logits.log_softmax(-1).gather(-1, w[:, 1:, None])[..., 0].flatten() / math.log(2))
        dists += [recurrence_distances(r[:-1], 2) for r in w]
    a, b, d = torch.cat(ours), torch.cat(theirs), torch.cat(dists)
    assert sum(r.positions for r in rows) == 4 * 24
    for r in rows:
        sel = (d == 0) if r.high == 0 else (d >= r.low) & (d < r.high)
        assert r.positions == int(sel.sum()) > 0
        assert r.loss == pytest.approx(float(a[sel].mean()), abs=1e-6)
        assert r.baseline == pytest.approx(float(b[sel].mean()), abs=1e-6)
        assert r.better == pytest.approx(float((a[sel] < b[sel]).double().mean()))


def test_analyze_routing_writes_its_tables_against_a_local_baseline(run_dir, capsys, tmp_path) -> None:
    root = run_dir.parent
    local = root / "local-run"
    if not local.exists():
        assert main(["train", "--config", str(root / "tiny.toml"), "--data-dir", str(root / "data"), "--out",
                     str(local), "--set", 'model.attention="local:2"']) == 0
    capsys.readouterr()
    out_dir = tmp_path / "out"
    assert main(["analyze", str(run_dir), "routing", "--baseline", str(local), "--windows", "4", "--top", "10",
                 "--out", str(out_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "beyond the local window %" in out and "The 10 most-attended routed pairs at distance >= 8" in out
    assert "not in the window" in out and "balance" in out
    for name in ("routing.txt", "routing-recurrence.csv", "routing-recurrence.png"):
        assert (out_dir / name).is_file() and str(out_dir / name) in out
    lines = (out_dir / "routing-recurrence.csv").read_text().splitlines()
    assert lines[0].startswith("low,high,positions") and sum(int(x.split(",")[2]) for x in lines[1:]) == 4 * 32
    assert "has no routing heads" in _one_line_error(capsys, ["analyze", str(local), "routing"])
    assert "--baseline" in _one_line_error(capsys, ["analyze", str(run_dir), "routing", "--baseline",
                                                    str(tmp_path / "nowhere")])


# --- analyze copying ----------------------------------------------------------------------------------------------

class _Recaller(torch.nn.Module):
    """A stand-in model over 256 tokens: where the input token occurred before, certain of the token that followed
    its latest earlier occurrence; elsewhere uniform (8 bits). ``recall=False``: uniform everywhere."""

    def __init__(self, seq_len: int, recall: bool = True) -> None:
        super().__init__()
        self.config, self.recall = SimpleNamespace(seq_len=seq_len), recall

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, 256)
        for b, row in enumerate(tokens.tolist()):
            for t, token in enumerate(row):
                earlier = [j for j in range(t) if row[j] == token]
                if self.recall and earlier:
                    logits[b, t, row[earlier[-1] + 1]] = 100.0
        return logits


def test_copy_gain_of_a_model_that_recalls_and_of_one_that_does_not() -> None:
    """Windows of distinct tokens: the first reading has nothing to recall (8 bits a token for both stand-ins); on
    the repeat the recaller is certain of every token but the first (whose predecessor is new: 8 bits)."""
    from routeformer.analysis.copying import copy_gain

    n = 32
    gen = torch.Generator().manual_seed(0)
    batches = [torch.stack([torch.randperm(256, generator=gen)[:n + 1] for _ in range(3)]) for _ in range(2)]
    for length in (8, 16):
        row, = copy_gain(_Recaller(n), batches, [length])
        assert row.windows == 6 and row.first == pytest.approx(8.0, abs=1e-6)
        assert row.repeat == pytest.approx(8.0 / (n - length + 1), abs=1e-6)  # one uncertain token of n - L + 1
        assert row.gain == pytest.approx(row.first - row.repeat)
    blind, = copy_gain(_Recaller(n, recall=False), batches, [8])
    assert blind.first == pytest.approx(8.0, abs=1e-6) and blind.repeat == pytest.approx(8.0, abs=1e-6)
    for bad in (1, n):
        with pytest.raises(ValueError, match=rf"repeat length must be in \[2, seq_len = {n}\), got {bad}"):
            copy_gain(_Recaller(n), batches, [bad])


def test_analyze_copying_writes_its_table(run_dir, capsys, tmp_path) -> None:
    capsys.readouterr()
    assert main(["analyze", str(run_dir), "copying", "--lengths", "8,4", "--windows", "3", "--out", str(tmp_path),
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "each of 3 windows cut to its first L tokens" in out and "\n| 4 | " in out and "\n| 8 | " in out
    lines = (tmp_path / "copying.csv").read_text().splitlines()
    assert lines[0] == "length,first_bits,repeat_bits,windows" and [x.split(",")[0] for x in lines[1:]] == ["4", "8"]
    assert all(float(x.split(",")[1]) > 0 and x.endswith(",3") for x in lines[1:])
    assert "--lengths must be comma-separated positive integers" in _one_line_error(
        capsys, ["analyze", str(run_dir), "copying", "--lengths", "x"])
    assert "repeat length must be in [2, seq_len" in _one_line_error(
        capsys, ["analyze", str(run_dir), "copying", "--lengths", "1"])
