"""Packed documents (issue 71): ids from lengths, cu_seqlens and separators; their checks; attention that never
crosses a document's boundary, for every pattern and the sorted window on every executor, against the dense
reference under the pattern's mask and the same document, and bit for bit isolated from the other documents."""

from __future__ import annotations

import pytest
import torch

from helpers import PATTERN_CASES, rand_qkv, rand_rel
from routeformer.attention import PATTERNS, Inputs, LocalOptions, local_attention, reference_attention
from routeformer.attention.routing.sorted_window import sort_by_cluster, sorted_window_attention, sorted_window_mask
from routeformer.documents import documents_from_cu_seqlens, documents_from_lengths, documents_from_separators
from routeformer.executors import get_executor

EXECUTORS = ["fused", "tiles", "flex"]
# the patterns of test_causality, one local window of them (the others add time, no new boundary case)
CASES = [case for case in PATTERN_CASES if case[0] != "local" or case[1]["window"] == 7]
LENGTHS = [[7, 1, 20, 17], [45]]  # a one-token document; a row that is one document


def same_document(documents: torch.Tensor) -> torch.Tensor:
    """(B, 1, N, N): key j is in query i's document (the definition, for the reference)."""
    return (documents[:, :, None] == documents[:, None, :])[:, None]


def test_ids_from_lengths_cu_seqlens_and_separators_written_out() -> None:
    assert documents_from_lengths([[3, 2], [1, 4]]).tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    cu = torch.tensor([0, 2, 7, 10], dtype=torch.int32)  # FlashAttention's varlen: two rows of 5, a document across
    assert documents_from_cu_seqlens(cu, batch=2).tolist() == [[0, 0, 1, 1, 1], [1, 1, 2, 2, 2]]
    tokens = torch.tensor([[5, 9, 5, 5, 9, 9, 1]])
    assert documents_from_separators(tokens, 9).tolist() == [[0, 0, 1, 1, 1, 2, 3]]


@pytest.mark.parametrize("call, message", [
    (lambda: documents_from_lengths([[3, 2], [4]]), "every row must sum to the same N"),
    (lambda: documents_from_lengths([[3, 0]]), "row 0 must list positive integer lengths"),
    (lambda: documents_from_lengths(torch.tensor([3])), "a non-empty list of rows"),
    (lambda: documents_from_cu_seqlens(torch.tensor([1, 3])), "must start at 0 and increase"),
    (lambda: documents_from_cu_seqlens(torch.tensor([0, 3, 3])), "must start at 0 and increase"),
    (lambda: documents_from_cu_seqlens(torch.tensor([0, 3]), batch=2), "3 tokens, which 2 rows cannot share"),
    (lambda: documents_from_separators(torch.zeros(4), 1), "tokens must be a \\(B, N\\) integer tensor"),
])
def test_the_constructors_name_what_is_wrong(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("documents, message", [
    (torch.tensor([[0, 0, 1, 0, 2, 2]]), "never decrease along a row .*row 0 goes from 1 to 0 at position 3"),
    (torch.zeros(1, 5, dtype=torch.long), r"shape \(B, N\) = \(1, 6\), got \(1, 5\)"),
    (torch.zeros(1, 6), "integer tensor of document ids, got dtype torch.float32"),
    (torch.zeros(1, 6, dtype=torch.bool), "integer tensor of document ids, got dtype torch.bool"),
    (torch.zeros(1, 6, dtype=torch.long, device="meta"), "documents is on meta but q is on cpu"),
    ([[0, 0, 0, 1, 1, 1]], "must be a torch.Tensor"),
])
def test_inputs_name_wrong_documents(documents, message: str) -> None:
    q, k, v = rand_qkv(1, 2, 6, 4, grad=False)
    with pytest.raises(ValueError, match=message):
        Inputs.of(q, k, v, documents=documents)


def test_ids_are_numbered_from_zero_in_each_row() -> None:
    q, k, v = rand_qkv(2, 1, 5, 4, grad=False)
    given = torch.tensor([[7, 7, 40, 41, 41], [-3, -3, -3, -3, -3]])
    assert Inputs.of(q, k, v, documents=given).documents.tolist() == [[0, 0, 1, 2, 2], [0, 0, 0, 0, 0]]
    # rows of one document each are rows without documents: the plain path
    assert Inputs.of(q, k, v, documents=torch.tensor([[3] * 5, [4] * 5])).documents is None


SLOW_FLEX = pytest.mark.slow  # FlexAttention's CPU path takes seconds a call: its relative cases run in the slow lines


@pytest.mark.parametrize("name, params", CASES)
@pytest.mark.parametrize("executor, relative", [("fused", False), ("fused", True), ("tiles", False),
                                                ("tiles", True), ("flex", False),
                                                pytest.param("flex", True, marks=SLOW_FLEX)])
@pytest.mark.parametrize("causal", [True, False])
def test_patterns_with_documents_equal_the_reference_under_their_mask_and_the_same_document(
        name: str, params: dict, executor: str, causal: bool, relative: bool) -> None:
    """Forward and gradients (q, k, v, the relative tables) in float64 against reference_attention under the
    pattern's own mask and 'the same document', two rows packed differently."""
    B, H, N, D = 2, 4, 45, 8
    q, k, v = rand_qkv(B, H, N, D)
    documents = documents_from_lengths(LENGTHS)
    rel = rand_rel(D, 6) if relative else None
    pattern = PATTERNS[name]
    out = pattern.run(Inputs.of(q, k, v, documents=documents), executor, causal=causal, rel=rel, **params)
    mask = pattern.build_mask(N, H, causal, **params)[None] & same_document(documents)
    ref = reference_attention(Inputs.of(q, k, v), mask, rel=rel)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    leaves = [q, k, v] + ([rel.key, rel.value] if rel is not None else [])
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _isolated(attend, documents: torch.Tensor, B: int, H: int, N: int, D: int) -> None:
    """Changing every input of one document changes no output or gradient of the others, bit for bit."""
    q, k, v = rand_qkv(B, H, N, D)
    changed = documents == 2  # (B, N)
    pick = changed[:, None, :, None]
    q2, k2, v2 = (torch.where(pick, torch.randn_like(x) * 3, x).detach().requires_grad_() for x in (q, k, v))
    outs, grads = [], []
    grad = torch.randn(B, H, N, D, dtype=q.dtype)
    for x in ((q, k, v), (q2, k2, v2)):
        out = attend(*x)
        outs.append(out)
        grads.append(torch.autograd.grad(out, x, grad, materialize_grads=True))  # k unused under shared QK
    keep = ~changed[:, None, :, None].expand(B, H, N, D)
    assert torch.equal(outs[0][keep], outs[1][keep])
    assert not torch.equal(outs[0][~keep], outs[1][~keep]), "the changed document's own outputs must change"
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a[keep], b[keep])


@pytest.mark.parametrize("name, params", CASES)
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("causal", [True, False])
def test_changing_one_document_changes_nothing_of_another_bit_for_bit(name: str, params: dict, executor: str,
                                                                      causal: bool) -> None:
    documents = documents_from_lengths(LENGTHS)
    pattern = PATTERNS[name]
    _isolated(lambda q, k, v: pattern.run(Inputs.of(q, k, v, documents=documents), executor, causal=causal,
                                          **params), documents, 2, 4, 45, 8)


@pytest.mark.parametrize("name, params", [("full", {}), ("local", {"window": 6})])
@pytest.mark.parametrize("executor", ["fused", "tiles", pytest.param("flex", marks=SLOW_FLEX)])
@pytest.mark.parametrize("causal", [True, False])
def test_a_packed_row_equals_each_document_run_alone(name: str, params: dict, executor: str, causal: bool) -> None:
    """Patterns that look only at distances between positions (full, local; relative positions too): each
    document of a packed row gives what it gives alone, to rounding."""
    q, k, v = rand_qkv(1, 2, 45, 8, grad=False)
    documents = documents_from_lengths(LENGTHS[:1])
    rel = rand_rel(8, 6)
    pattern = PATTERNS[name]
    packed = pattern.run(Inputs.of(q, k, v, documents=documents), executor, causal=causal, rel=rel, **params)
    start = 0
    for length in LENGTHS[0]:
        part = slice(start, start + length)
        alone = pattern.run(Inputs.of(q[:, :, part], k[:, :, part], v[:, :, part]), executor, causal=causal,
                            rel=rel, **{**params, **({"window": min(params["window"], length)} if params else {})})
        torch.testing.assert_close(packed[:, :, part], alone, rtol=1e-12, atol=1e-12)
        start += length


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_the_sorted_window_keeps_each_cluster_within_its_document(executor: str, causal: bool, shared: bool) -> None:
    """Routing's and LSH's band over the cluster-sorted sequence: a query sees the last `window` keys of its own
    (cluster, document), never spending a slot on another document's keys: the reference is the sorted window's
    mask over the clusters relabelled (document, cluster)."""
    from routeformer.attention.routing import RoutingOptions

    B, H, N, D, k, window = 2, 3, 45, 8, 3, 4
    q, kk, v = rand_qkv(B, H, N, D)
    kk = q if shared else kk
    documents = documents_from_lengths(LENGTHS)
    clusters = torch.randint(0, k, (B, H, N), generator=torch.Generator().manual_seed(4))
    options = RoutingOptions(num_clusters=k, window=window, shared_qk=shared)
    out = sorted_window_attention(Inputs.of(q, kk, v, documents=documents), sort_by_cluster(clusters), options,
                                  executor=get_executor(executor, "cpu"), causal=causal)
    labels = clusters * N + documents[:, None, :]
    mask = sorted_window_mask(labels, window, causal, shared)
    ref = reference_attention(Inputs.of(q, kk, v), mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    leaves = [q, v] if shared else [q, kk, v]
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _probes(B: int, H: int, N: int, k: int, p: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key clusters (B, H, N) and p distinct probes per query (B, H, N, p), the own cluster first."""
    g = torch.Generator().manual_seed(seed)
    clusters = torch.randint(0, k, (B, H, N), generator=g)
    others = torch.rand(B, H, N, k, generator=g).scatter(-1, clusters[..., None], -1.0).argsort(-1, descending=True)
    return clusters, torch.cat([clusters[..., None], others[..., :p - 1]], -1)


@pytest.mark.parametrize("executor, N", [("fused", 45), ("tiles", 45), ("tiles", 300), ("flex", 45)])
@pytest.mark.parametrize("shared, gated", [(False, False), (True, False), (False, True)])
def test_probes_look_into_the_querys_own_document_only(executor: str, N: int, shared: bool, gated: bool) -> None:
    """Multi-probe routing (separate and gated too): each probe reads the last `window` keys of its cluster in the
    query's own document; the reference is ``probed_window_mask`` over the labels relabelled (document, cluster),
    forward and gradients in float64 (N = 300 takes the tiles executor's ranges, 45 its dense tile); and changing
    one document changes nothing of another, bit for bit."""
    from routeformer.attention.routing import RoutingOptions
    from routeformer.attention.routing.probes import probe_masks, probed_window_attention, probed_window_mask

    B, H, D, k, p, window = 2, 3, 8, 3, 2, 4
    lengths = [[7, 1, 20, 17], [45]] if N == 45 else [[40, 1, 150, 109], [300]]
    documents = documents_from_lengths(lengths)
    clusters, probes = _probes(B, H, N, k, p)
    gates = torch.rand(B, H, N, p, dtype=torch.float64) if gated else None
    options = RoutingOptions(num_clusters=k, window=window, probes=p, shared_qk=shared)
    ex = get_executor(executor, "cpu")
    labels = documents[:, None, :] * k + clusters

    def attend(q, kk, v):
        kk = q if shared else kk
        return probed_window_attention(Inputs.of(q, kk, v, documents=documents), clusters, probes, options,
                                       sort=sort_by_cluster(labels), executor=ex, gates=gates)

    q, kk, v = rand_qkv(B, H, N, D)
    out = attend(q, kk, v)
    wanted = probes + (documents[:, None, :] * k)[..., None]
    if gated:  # each probe its own softmax, scaled by its gate
        masks = probe_masks(labels, wanted, window)
        ref = sum(reference_attention(Inputs.of(q, kk, v), masks[:, :, t]) * gates[..., t, None] for t in range(p))
    else:
        ref = reference_attention(Inputs.of(q, q if shared else kk, v),
                                  probed_window_mask(labels, wanted, window, shared))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    leaves = [q, v] if shared else [q, kk, v]
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    _isolated(attend, documents, B, H, N, D)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("causal", [True, False])
def test_lsh_hashes_each_document_into_buckets_of_its_own(executor: str, causal: bool) -> None:
    """LSH's bucket is (document, bucket): every round's window stays in the query's document. Against
    ``reference_attention`` under ``lsh_mask(documents=...)`` (the keys the unit queries), forward and gradients in
    float64, and isolated bit for bit."""
    from routeformer.attention import lsh_attention
    from routeformer.attention.lsh import LSHOptions, lsh_mask

    B, H, N, D = 2, 3, 45, 8
    documents = documents_from_lengths(LENGTHS)
    options = LSHOptions(buckets=4, rounds=2, window=3)

    def attend(q, k, v):
        return lsh_attention(Inputs.of(q, q, v, documents=documents), options, executor, causal=causal, seed=3)

    q, _, v = rand_qkv(B, H, N, D)
    out = attend(q, q, v)
    mask = lsh_mask(q.detach(), buckets=4, rounds=2, window=3, causal=causal, rotations=3, documents=documents)
    assert not (mask & ~same_document(documents)).any()
    ref = reference_attention(Inputs.of(q, torch.nn.functional.normalize(q, dim=-1), v), mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, v], grad), torch.autograd.grad(ref, [q, v], grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    _isolated(attend, documents, B, H, N, D)


def _feature_definition(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, causal: bool,
                        documents: torch.Tensor) -> torch.Tensor:
    """Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) over j <= i (causal) of i's document: the quadratic form."""
    N = v.shape[2]
    allow = same_document(documents) & (torch.ones(N, N, dtype=torch.bool).tril() if causal else True)
    weights = (phi_q @ phi_k.transpose(-1, -2)) * allow
    total = weights.sum(-1, keepdim=True)
    return (weights @ v) / torch.where(total > 0, total, 1.0)  # a row that sees no key (all padded): zeros


@pytest.mark.parametrize("kind", ["performer", "elu", "poly2"])
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("causal", [True, False])
def test_feature_sums_restart_at_every_boundary(kind: str, executor: str, causal: bool) -> None:
    """Performer and linear (elu, poly2) attention: every sum over the query's own document, in chunks of 8 that
    straddle the boundaries (the scan's restart, its recomputing backward, the non-causal states per document);
    against the quadratic form under 'the same document' (float64, forward and gradients), and isolated bit for
    bit. The fused executor's scan kernels run each document as a sequence of its own (its chunks from its start)."""
    from routeformer.attention import linear_attention, performer_attention
    from routeformer.attention.kernels import feature_map
    from routeformer.attention.linear import LinearOptions
    from routeformer.attention.performer import orthogonal_features, performer_features

    B, H, N, D = 2, 2, 45, 4
    documents = documents_from_lengths(LENGTHS)
    projection = orthogonal_features(H, 6, D, generator=torch.Generator().manual_seed(2)).double()

    def attend(q, k, v):
        inputs = Inputs.of(q, k, v, documents=documents)
        if kind == "performer":
            return performer_attention(inputs, None, executor, causal=causal, projection=projection, chunk=8)
        return linear_attention(inputs, LinearOptions(kernel=kind), executor, causal=causal, chunk=8)

    q, k, v = rand_qkv(B, H, N, D)
    out = attend(q, k, v)
    if kind == "performer":
        phi_q, phi_k = (performer_features(x, projection, D ** -0.5, query=t) for x, t in ((q, True), (k, False)))
    else:
        scale = D ** -0.5 if kind == "poly2" else None
        phi_q, phi_k = feature_map(kind, q, scale), feature_map(kind, k, scale)
    ref = _feature_definition(phi_q, phi_k, v, causal, documents)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, k, v], grad), torch.autograd.grad(ref, [q, k, v], grad),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    _isolated(attend, documents, B, H, N, D)


@pytest.mark.parametrize("kind", ["performer", "elu", "poly2"])
@pytest.mark.parametrize("causal", [True, False])
def test_feature_sums_with_documents_leave_padded_keys_out(kind: str, causal: bool) -> None:
    """Padded keys with documents (poly2's exact within-chunk weights too): against the quadratic form under 'the
    same document' and the keys' validity, forward and gradients."""
    from routeformer.attention import linear_attention, performer_attention
    from routeformer.attention.kernels import feature_map
    from routeformer.attention.linear import LinearOptions
    from routeformer.attention.performer import orthogonal_features, performer_features

    B, H, N, D = 2, 2, 45, 4
    documents = documents_from_lengths(LENGTHS)
    valid = torch.rand(B, N, generator=torch.Generator().manual_seed(8)) > 0.3
    projection = orthogonal_features(H, 6, D, generator=torch.Generator().manual_seed(2)).double()
    q, k, v = rand_qkv(B, H, N, D)
    inputs = Inputs.of(q, k, v, key_padding_mask=valid, documents=documents)
    if kind == "performer":
        out = performer_attention(inputs, None, "tiles", causal=causal, projection=projection, chunk=8)
        phi_q, phi_k = (performer_features(x, projection, D ** -0.5, query=t) for x, t in ((q, True), (k, False)))
    else:
        out = linear_attention(inputs, LinearOptions(kernel=kind), "tiles", causal=causal, chunk=8)
        scale = D ** -0.5 if kind == "poly2" else None
        phi_q, phi_k = feature_map(kind, q, scale), feature_map(kind, k, scale)
    ref = _feature_definition(phi_q, phi_k * valid[:, None, :, None], v, causal, documents)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, k, v], grad), torch.autograd.grad(ref, [q, k, v], grad),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_fused_scan_with_documents_and_padding_equals_the_pytorch_scan() -> None:
    """Padded keys with documents: the fused kernels' result (each document a sequence of its own) is the PyTorch
    scan's (which restarts at every boundary), forward and gradients; and each packed document's output is the one
    it gets alone, bit for bit."""
    from routeformer.attention import linear_attention

    q, k, v = rand_qkv(2, 2, 45, 4)
    valid = torch.rand(2, 45, generator=torch.Generator().manual_seed(7)) > 0.3
    inputs = Inputs.of(q, k, v, key_padding_mask=valid, documents=documents_from_lengths(LENGTHS))
    fused, tiles = (linear_attention(inputs, None, executor, chunk=8) for executor in ("fused", "tiles"))
    torch.testing.assert_close(fused, tiles, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(fused)
    for a, b in zip(torch.autograd.grad(fused, [q, k, v], grad), torch.autograd.grad(tiles, [q, k, v], grad),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    start = 0
    for length in LENGTHS[0]:
        part = slice(start, start + length)
        alone = linear_attention(Inputs.of(q[:1, :, part], k[:1, :, part], v[:1, :, part],
                                           key_padding_mask=valid[:1, part]), None, "fused", chunk=8)
        assert torch.equal(fused[:1, :, part], alone)
        start += length


@pytest.mark.parametrize("kernel", ["poly2", "elu"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_exact_kernels_stay_in_their_document(kernel: str, causal: bool) -> None:
    """local and full attention under poly2 / elu (``kernel_attention``, the quadratic form): the query's own
    document's keys only, against the definition, isolated bit for bit."""
    from routeformer.attention.kernels import feature_map

    B, H, N, D = 2, 2, 45, 4
    documents = documents_from_lengths(LENGTHS)

    def attend(q, k, v):
        return local_attention(Inputs.of(q, k, v, documents=documents), LocalOptions(window=N, kernel=kernel),
                               causal=causal)

    q, k, v = rand_qkv(B, H, N, D)
    scale = D ** -0.5 if kernel == "poly2" else None
    ref = _feature_definition(feature_map(kernel, q, scale), feature_map(kernel, k, scale), v, causal, documents)
    torch.testing.assert_close(attend(q, k, v), ref, rtol=1e-10, atol=1e-10)
    _isolated(attend, documents, B, H, N, D)


def _blocks_definition(heads, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
                       score: str) -> torch.Tensor:
    """MoBA ('mean', 'bound') or NSA ('nsa') over packed documents, written out query by query: the candidates are
    the complete blocks before the query's own from the one holding its document's start, each summarised by its
    document's keys only (the partial first block too); the top ones by rank; every range from the start on."""
    B, H, N, D = q.shape
    b = heads.block
    top = heads.top_k if score != "nsa" else heads.top
    scale = D ** -0.5
    mask = torch.zeros(B, H, N, N, dtype=torch.bool)
    out_cmp = torch.zeros_like(q)
    for x in range(B):
        for i in range(N):
            start = int((documents[x] == documents[x, i]).nonzero()[0])
            candidates = list(range(start // b, min(i // b, N // b)))
            keys = [list(range(max(j * b, start), (j + 1) * b)) for j in candidates]
            for h in range(H):
                qi = q[x, h, i]
                if score == "mean":
                    scores = [qi @ k[x, h, ks].mean(0) for ks in keys]
                elif score == "bound":
                    scores = [(qi.clamp(min=0) * (k[x, h, ks].amax(0) - k[x, h, ks].amin(0))
                               + qi * k[x, h, ks].amin(0)).sum() for ks in keys]
                else:
                    a, c = heads.key_weights[h], heads.value_weights[h]
                    ck = [(a[[t % b for t in ks], None] * k[x, h, ks]).sum(0) for ks in keys]
                    cv = [(c[[t % b for t in ks], None] * v[x, h, ks]).sum(0) for ks in keys]
                    scores = [qi @ kk * scale for kk in ck]
                    if scores:
                        out_cmp[x, h, i] = (torch.stack(scores).softmax(0)[:, None] * torch.stack(cv)).sum(0)
                ranked = sorted(range(len(keys)), key=lambda m: -float(scores[m].detach()))[:top]
                for m in ranked:
                    mask[x, h, i, keys[m]] = True
                mask[x, h, i, max(i // b * b, start):i + 1] = True
    out_sel = reference_attention(Inputs.of(q, k, v), mask)
    if score != "nsa":
        return out_sel
    i = torch.arange(N)
    window = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < heads.window) & same_document(documents)).expand(
        B, H, N, N)
    out_win = reference_attention(Inputs.of(q, k, v), window)
    g = heads.gates(q)
    return g[..., 0:1] * out_cmp + g[..., 1:2] * out_sel + g[..., 2:3] * out_win


@pytest.mark.parametrize("kind", ["mean", "bound", "nsa"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_block_selection_chooses_among_its_own_documents_blocks(kind: str, executor: str) -> None:
    """MoBA (mean, bound) and NSA heads over packed documents: against the definition written out query by query
    (float64, forward and gradients), and isolated bit for bit."""
    from routeformer.attention.moba import MobaHeads, MobaOptions
    from routeformer.attention.nsa import NsaHeads, NsaOptions

    B, H, N, D = 2, 2, 45, 8
    torch.manual_seed(0)
    if kind == "nsa":
        heads = NsaHeads(H, D, NsaOptions(block=4, top=2, window=5)).double()
        with torch.no_grad():
            for p in heads.parameters():  # weights that differ per position, gates that differ per branch
                p.add_(torch.randn_like(p) * 0.3)
    else:
        heads = MobaHeads(H, D, MobaOptions(block=4, top_k=2, score=kind)).double()
    heads.executor = get_executor(executor, "cpu")
    documents = documents_from_lengths([[6, 1, 21, 17], [45]])  # a partial first block, a document inside one

    def attend(q, k, v):
        return heads(q, k, v, None, documents=documents)

    q, k, v = rand_qkv(B, H, N, D)
    out = attend(q, k, v)
    ref = _blocks_definition(heads, q, k, v, documents, kind)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, k, v], grad), torch.autograd.grad(ref, [q, k, v], grad),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    _isolated(attend, documents, B, H, N, D)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("which", [0, 2])
def test_key_ranges_within_their_documents_isolate_them_bit_for_bit(executor: str, which: int) -> None:
    """Key ranges laid within their queries' documents and said so (``Ranges.documents``), wide enough that a
    document's entries span several of the fused kernel's key chunks (512 keys) and blocks: changing one document's
    inputs and ranges (as routing's clusters move with its tokens) moves no output or gradient of the others, bit
    for bit. The fused kernel ends its blocks of entries where the queries' document changes; a block straddling a
    boundary would sum one document's products over a chunk grid that the other's ranges set."""
    from routeformer.executors.ranges import Ranges

    B, H, N, D = 1, 2, 1300, 8
    documents = documents_from_lengths([[500, 200, 600]])
    i = torch.arange(N)
    start = torch.searchsorted(documents[0], documents[0])  # each position's document's first position
    changed = documents[0] == which
    run = get_executor(executor, "cpu")
    draw = [start + (torch.rand(N, generator=torch.Generator().manual_seed(s)) * (i + 2 - start)).long()
            for s in (4, 5)]
    splits = [draw[0], torch.where(changed, draw[1], draw[0])]  # one document's ranges move
    q, k, v = rand_qkv(B, H, N, D)
    inputs = [(q, k, v), tuple(torch.where(changed[:, None], torch.randn_like(x) * 3, x).detach().requires_grad_()
                               for x in (q, k, v))]  # ... and its inputs change
    grad = torch.randn(B, H, N, D, dtype=q.dtype)
    outs, grads = [], []
    for x, split in zip(inputs, splits, strict=True):
        lo = torch.stack([start, split], -1).view(1, 1, 2 * N)  # entry 2i + t: two disjoint ranges in [start, i]
        hi = torch.stack([split, i + 1], -1).view(1, 1, 2 * N)
        out, _ = run.ranges(Inputs.of(*x), Ranges(lo, hi, width=600, merge=2, documents=documents))
        outs.append(out)
        grads.append(torch.autograd.grad(out, x, grad))
    keep = ~changed
    assert torch.equal(outs[0][:, :, keep], outs[1][:, :, keep])
    assert not torch.equal(outs[0][:, :, changed], outs[1][:, :, changed])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a[:, :, keep], b[:, :, keep])


def test_ranges_name_wrong_documents() -> None:
    from routeformer.executors.ranges import Ranges

    q, k, v = rand_qkv(2, 1, 4, 2, grad=False)
    lo, hi = torch.zeros(2, 1, 4, dtype=torch.long), torch.ones(2, 1, 4, dtype=torch.long)
    for wrong in (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"Ranges.documents must be \(B, Nq\) = \(2, 4\) long on cpu"):
            get_executor("fused", "cpu").ranges(Inputs.of(q, k, v), Ranges(lo, hi, 1, documents=wrong))


def test_attention_over_key_ranges_given_as_they_are_refuses_documents() -> None:
    """Attention over key ranges given as they are (blocks selected without their documents): an error names it,
    nothing attends across a boundary."""
    from routeformer.attention.blocks import selected_attention

    q, k, v = rand_qkv(1, 2, 16, 4, grad=False)
    chosen = torch.zeros(1, 2, 16, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="attention over key ranges.* does not honour packed documents yet"):
        selected_attention(Inputs.of(q, k, v, documents=documents_from_lengths([[8, 8]])), chosen, 4,
                           get_executor("tiles", "cpu"), None)


def _balanced(shared: bool):
    from routeformer.attention.routing import RoutingAttention, RoutingOptions

    torch.manual_seed(3)
    layer = RoutingAttention(2, 8, RoutingOptions(num_clusters=3, window=5, probes=1, balance=0.0, shared_qk=shared),
                             causal=False, balanced=True).double().eval()
    return layer


@pytest.mark.parametrize("executor", ["fused", "tiles", pytest.param("flex", marks=SLOW_FLEX)])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("relative", [False, True])
def test_balanced_routing_gives_each_packed_document_what_it_gets_alone(executor: str, shared: bool,
                                                                       relative: bool) -> None:
    """Balanced (non-causal) routing over packed documents: each document's clusters take the min(window, length)
    of its own tokens nearest each centroid, so each document gets what it gets alone, to rounding; lengths of
    several tiers (1, 3, 7, 14, 20), a padded key inside one, forward and gradients."""
    layer = _balanced(shared)
    layer.executor = get_executor(executor, "cpu")
    lengths = [[7, 1, 20, 17], [3, 14, 28]]
    B, H, N, D = 2, 2, 45, 8
    q, k, v = rand_qkv(B, H, N, D)
    padding = torch.ones(B, N, dtype=torch.bool)
    padding[1, 20] = False  # a padded key inside the second row's second document
    rel = rand_rel(D, 6) if relative else None
    documents = documents_from_lengths(lengths)
    packed = layer(q, k, v, rel, key_padding_mask=padding, documents=documents)
    grad = torch.randn_like(packed)
    got = torch.autograd.grad(packed, (q, k, v), grad)
    for b, row in enumerate(lengths):
        start = 0
        for length in row:
            part = slice(start, start + length)
            x = [t[b:b + 1, :, part].detach().requires_grad_() for t in (q, k, v)]
            alone = layer(*x, rel, key_padding_mask=padding[b:b + 1, part])
            torch.testing.assert_close(packed[b:b + 1, :, part], alone, rtol=1e-12, atol=1e-12)
            for want, g in zip(torch.autograd.grad(alone, x, grad[b:b + 1, :, part]), got, strict=True):
                torch.testing.assert_close(g[b:b + 1, :, part], want, rtol=1e-12, atol=1e-12)
            start += length


def test_balanced_routing_keeps_each_document_apart_bit_for_bit() -> None:
    layer = _balanced(True)
    layer.executor = get_executor("fused", "cpu")
    documents = documents_from_lengths(LENGTHS)
    _isolated(lambda q, k, v: layer(q, k, v, documents=documents), documents, 2, 2, 45, 8)


def test_documents_need_self_attention_where_they_become_key_groups() -> None:
    """A tiling of other queries than keys (or rows) cannot take documents as key groups: an error names it."""
    from routeformer.executors import Tiling

    q, k, v = rand_qkv(1, 1, 8, 4, grad=False)
    inputs = Inputs.of(q, k, v, documents=documents_from_lengths([[4, 4]]))
    for executor in EXECUTORS:
        with pytest.raises(ValueError, match="documents need self-attention .*got 3 queries and 8 keys"):
            get_executor(executor, "cpu").tiled(inputs.with_(q=q[:, :, :3]), Tiling.dense(3))


# --- the model ---------------------------------------------------------------------------------------------------

MODEL_KINDS = [  # (attention, options, positions): every kind a model may pack documents with, routing past warm-up
    ("local:2,routing:2", {"local": {"window": 6}, "routing": {"num_clusters": 3, "window": 4, "probes": 1}},
     "relative"),
    ("full:2,local:2", {"local": {"window": 6}}, "absolute"),
    ("strided:2,fixed:2", {"strided": {"stride": 4}, "fixed": {"block": 8, "summary": 2}}, "relative"),
    ("longformer:4", {"longformer": {"window": 4, "global_tokens": [0, 3]}}, "factorized"),
    ("routing:2,lsh:2", {"routing": {"num_clusters": 3, "window": 4, "probes": 2, "separate": True,
                                     "shared_qk": False},
                         "lsh": {"buckets": 4, "rounds": 2, "window": 3}}, "absolute"),
    ("local:2,routing:2", {"local": {"window": 6}, "routing": {"num_clusters": 3, "window": 4, "probes": 2,
                                                               "gate": True}}, "relative"),
    ("performer:2,linear:2", {"linear": {"kernel": "poly2"}}, "absolute"),
    ("moba:2,nsa:2", {"moba": {"block": 4, "top_k": 2, "score": "bound"}, "nsa": {"block": 4, "top": 2, "window": 5}},
     "relative"),
]


def _model(attention: str, options: dict, positions: str, token_shift: str = "learned", backend: str = "auto"):
    from routeformer import TransformerConfig, TransformerLM

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=32, dim=32, depth=2, heads=4, seq_len=48, attention=attention,
                               options=options, positions=positions, rel_clip=5, grid_width=8,
                               token_shift=token_shift, backend=backend)
    model = TransformerLM(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():  # token shift's mix starts at 0: give it weight, so that a leak would show
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("attention, options, positions", MODEL_KINDS)
@pytest.mark.parametrize("backend", ["fused", "tiles"])
@pytest.mark.parametrize("token_shift", ["learned", "half"])
def test_a_model_scores_each_packed_document_bit_for_bit_apart_from_the_others(attention, options, positions,
                                                                              backend, token_shift) -> None:
    """Changing one document's tokens changes no logit of another, bit for bit: attention, the token shift and the
    positions stop at every boundary. The fused kernels end their blocks where a document does (the band and rounds
    kernels where a run of sorted groups ends, the ranges kernel where its entries' query changes document), so a
    block's key span, and every sum's order, is its own document's."""
    model = _model(attention, options, positions, token_shift, backend)
    documents = documents_from_lengths([[7, 1, 20, 20], [48]])
    tokens = torch.randint(0, 32, (2, 48), generator=torch.Generator().manual_seed(1))
    other = tokens.clone()
    changed = documents == 2
    other[changed] = (other[changed] + 1 + torch.randint(0, 30, (int(changed.sum()),))) % 32
    a, b = model(tokens, documents=documents), model(other, documents=documents)
    assert torch.equal(a[~changed], b[~changed])
    assert not torch.equal(a[changed], b[changed])
    without = model(tokens)  # and without documents the later documents do see the earlier ones
    assert not torch.equal(without[0, 8:], a[0, 8:])


@pytest.mark.parametrize("attention, options, positions", MODEL_KINDS[:2] + [("local:4", {"local": {"window": 6}},
                                                                              "absolute")])
def test_a_packed_row_gives_each_document_the_logits_it_gets_alone(attention, options, positions) -> None:
    """Kinds that look at distances only (local, full, routing) give a packed document's logits as the document
    alone gives them, to rounding: positions from its start, no predecessor for the token shift."""
    model = _model(attention, options, positions)
    lengths = [7, 1, 20, 20]
    tokens = torch.randint(0, 32, (1, 48), generator=torch.Generator().manual_seed(2))
    packed = model(tokens, documents=documents_from_lengths([lengths]))
    start = 0
    for n in lengths:
        alone = model(tokens[:, start:start + n])
        torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-10, atol=1e-10)
        start += n


DECODE_KINDS = MODEL_KINDS + [
    ("fixed:2,linear:2", {"fixed": {"block": 8, "summary": 2}, "linear": {"kernel": "elu"}}, "absolute"),
    ("routing:2,local:2", {"routing": {"num_clusters": 3, "window": 4, "probes": 1}, "local": {"window": 6}},
     "relative"),
]


@pytest.mark.parametrize("attention, options, positions", DECODE_KINDS)
@pytest.mark.parametrize("prompt", [1, 10])
def test_decoding_across_documents_gives_the_forwards_logits(attention, options, positions, prompt) -> None:
    """A prompt of several documents, then one token at a time with each row's ids: a row begins a new document
    mid-decoding (row 0 at 28) while the other goes on, every cache (rings, key stores, the linear sums, the
    blocks' summaries, the token shift, the absolute positions) reading nothing before its document: the logits
    are the forward's over the whole packed rows. ``prompt`` 1 decodes the boundaries at 6 and 7 (a one-token
    document) step by step too; the documents at 7 and 28 begin inside a block of MoBA's and NSA's (block 4), whose
    later queries select that partial block."""
    model = _model(attention, options, positions)
    documents = documents_from_lengths([[6, 1, 21, 20], [48]])
    tokens = torch.randint(0, 32, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model(tokens, documents=documents)
        cache = model.new_cache(2, 48)
        parts = [model(tokens[:, :prompt], cache, documents=documents[:, :prompt])]
        parts += [model(tokens[:, t:t + 1], cache, documents=documents[:, t:t + 1]) for t in range(prompt, 48)]
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-9, atol=1e-9)


def test_a_cache_continues_each_rows_last_document_and_refuses_ids_that_go_back() -> None:
    model = _model("local:2,routing:2", MODEL_KINDS[0][1], "relative")
    documents = documents_from_lengths([[7, 9], [16]])
    tokens = torch.randint(0, 32, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model(tokens, documents=torch.cat([documents, documents[:, -1:].expand(2, 4)], 1))
        cache = model.new_cache(2, 21)
        first = model(tokens[:, :16], cache, documents=documents)
        rest = [model(tokens[:, t:t + 1], cache) for t in range(16, 20)]  # no ids: each row's last document goes on
    torch.testing.assert_close(torch.cat([first, *rest], 1), whole, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="never decrease along a row, the cached positions included: row 0 goes "
                                         "from 1 to 0 at position 20"):
        model(tokens[:, :1], cache, documents=torch.zeros(2, 1, dtype=torch.long))


def test_a_cache_refuses_a_kind_that_cannot_honour_documents_only_past_a_boundary() -> None:
    """One document a row decodes as without documents, whatever the heads; a boundary names the kind."""
    import dataclasses

    from routeformer.attention.registry import get_kind, register_kind, unregister_kind
    register_kind(dataclasses.replace(get_kind("local"), name="undocumented", documents=False))
    try:
        model = _model("local:2,undocumented:2", {"local": {"window": 6}, "undocumented": {"window": 6}}, "absolute")
        tokens = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            cache = model.new_cache(2, 10)
            one = model(tokens[:, :8], cache, documents=torch.zeros(2, 8, dtype=torch.long))
            later = model(tokens[:, 8:9], cache)  # the ids go on: still one document a row
            torch.testing.assert_close(torch.cat([one, later], 1), model(tokens[:, :9]), rtol=1e-9, atol=1e-9)
            with pytest.raises(ValueError, match="undocumented heads .* do not honour packed documents yet"):
                model(tokens[:, 9:], cache, documents=torch.tensor([[0], [1]]))
    finally:
        unregister_kind("undocumented")


@pytest.mark.parametrize("attention, options, positions", [MODEL_KINDS[0], ("lsh:2,linear:2", {"lsh": {
    "buckets": 4, "window": 3}}, "none")])
def test_generating_after_a_prompt_of_several_documents_continues_the_last_as_if_alone(attention, options,
                                                                                       positions) -> None:
    model = _model(attention, options, positions)
    prompt = torch.randint(0, 32, (2, 20), generator=torch.Generator().manual_seed(5))
    documents = documents_from_lengths([[8, 12], [20]])
    packed = model.generate(prompt, 10, temperature=0, documents=documents)
    alone = model.generate(prompt[:1, 8:], 10, temperature=0)
    assert torch.equal(packed[0, 20:], alone[0, 12:])
    assert torch.equal(packed[1], model.generate(prompt[1:], 10, temperature=0)[0])  # the other row as it was
    with pytest.raises(ValueError, match=r"documents must be a tensor of the prompt's shape \(2, 20\)"):
        model.generate(prompt, 2, documents=documents[:, :5])


def test_a_model_refuses_documents_with_kinds_that_cannot_honour_them_and_ids_that_decrease() -> None:
    documents = documents_from_lengths([[4, 12]])
    tokens = torch.zeros(1, 16, dtype=torch.long)
    import dataclasses

    from routeformer.attention.registry import get_kind, register_kind, unregister_kind
    register_kind(dataclasses.replace(get_kind("local"), name="undocumented", documents=False))  # a user's kind
    try:
        model = _model("local:2,undocumented:2", {"local": {"window": 6}, "undocumented": {"window": 6}}, "absolute")
        with pytest.raises(ValueError, match="undocumented heads .* do not honour packed documents yet"):
            model(tokens, documents=documents)
    finally:
        unregister_kind("undocumented")
    with pytest.raises(ValueError, match="never decrease"):
        model(tokens, documents=torch.tensor([[1] * 8 + [0] * 8]))


FLEX_LENGTHS = [[128, 300, 212], [45, 595]]  # N = 640: five blocks of 128, one document a whole block, one across


@pytest.mark.parametrize("name, params", [("full", {}), ("local", {"window": 200}), ("strided", {"stride": 4})])
@pytest.mark.parametrize("causal", [True, False])
def test_flex_block_tables_for_documents_are_those_of_their_pairs(name: str, params: dict, causal: bool,
                                                                  monkeypatch) -> None:
    """The flex executor's block tables for packed documents come from the pattern's tables without them, narrowed
    by each block's first and last document (``blocks._labelled``): the full blocks are exactly those whose every
    pair the whole rule allows, the partial ones every other block holding an allowed pair (and at most some that
    hold none); the output equals the reference's in float64."""
    from routeformer.executors.flex import blocks

    seen = []
    labelled = blocks._labelled

    def spy(pattern, device, block):
        mask = labelled(pattern, device, block)
        seen.append((mask, blocks._tables_of(pattern, pattern.labels.shape[0], 1, device, block)))
        return mask

    monkeypatch.setattr(blocks, "_labelled", spy)
    B, H, N, D = 2, 2, 640, 8
    q, k, v = rand_qkv(B, H, N, D, grad=False)
    documents = documents_from_lengths(FLEX_LENGTHS)
    pattern = PATTERNS[name]
    out = pattern.run(Inputs.of(q, k, v, documents=documents), "flex", causal=causal, **params)
    mask = pattern.build_mask(N, H, causal, **params)[None] & same_document(documents)
    torch.testing.assert_close(out, reference_attention(Inputs.of(q, k, v), mask), rtol=1e-10, atol=1e-10)
    assert seen, "the documents' block tables were not built from the pattern's own"
    for got, pairs in seen:
        nkb, rows = got.kv_indices.shape[-1], pairs.some.shape[0]  # rows: B, or B · stride for the grid's columns

        def blocks_of(count, indices, nkb=nkb):  # (B, 1, nqb, nkb) bool from FlexAttention's (count, indices)
            table = torch.zeros(*count.shape, nkb + 1, dtype=torch.bool)
            listed = torch.arange(indices.shape[-1]) < count[..., None]
            table.scatter_(-1, torch.where(listed, indices.long(), nkb), listed)
            return table[..., :nkb]

        full = blocks_of(got.full_kv_num_blocks, got.full_kv_indices)
        partial = blocks_of(got.kv_num_blocks, got.kv_indices)
        cand = pairs.cand.expand(rows, 1, *pairs.cand.shape)
        want_full = blocks_of(pairs.every.sum(-1), torch.where(pairs.every, cand, nkb).sort(-1).values)
        want_some = blocks_of(pairs.some.sum(-1), torch.where(pairs.some, cand, nkb).sort(-1).values)
        assert torch.equal(full, want_full)
        assert bool((want_some & ~want_full & ~partial).sum() == 0)  # every block with an allowed pair is listed
        assert not bool((full & partial).any())
        if name == "full":  # blocks sharing a document share an allowed pair: the listed are exactly those
            assert torch.equal(full | partial, want_some)


def _flex_local_step(N: int, monkeypatch) -> object:
    """One forward and backward of causal local attention (window 256, 8 heads of 64, bfloat16 as on a GPU) over a
    row of 16 packed documents on the flex executor, on the ``meta`` device (the ids already numbered, as
    ``Inputs.of`` leaves them: checking them reads the device)."""
    from helpers import OperatorCount
    from routeformer.executors.flex import ops as flex_ops
    from routeformer.executors.pieces import Band

    monkeypatch.setattr(flex_ops, "flex_call", lambda q, k, v, **_: (q + v.mean(2, keepdim=True), q.float().sum(-1)))
    q = torch.empty(1, 8, N, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(1, 8, N, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    documents = torch.empty(1, N, device="meta", dtype=torch.long)
    executor = get_executor("flex")
    for _ in range(2):  # the second call is counted: the first also makes what the sizes alone decide, once
        with OperatorCount() as count:
            out = executor.tiled(Inputs(q, q, v, 0.125, documents=documents), Band(256, True))[0]
            out.float().sum().backward()
    return count


def test_flex_block_tables_for_documents_take_as_many_operators_at_any_length(monkeypatch) -> None:
    """At 65,536 and 262,144 positions the documents' block tables take the same operators (no chunk loop over
    pairs, whose count grows with N), none larger than FlexAttention's own (B, nqb, nkb) tables."""
    small, large = _flex_local_step(65536, monkeypatch), _flex_local_step(262144, monkeypatch)
    assert small.ops == large.ops
    assert large.largest <= 8 * 262144 * 64  # the inputs' size: no (N, block) pairs evaluated per head
