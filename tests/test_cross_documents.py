"""Packed documents across two sequences (``CrossDocuments``): query document d reads memory document d only, on
every executor, against the dense definition (the reference's mask and the same-document mask), forward and
gradients, for every kind that reads a memory; each document scored as if it were alone."""

from __future__ import annotations

import pytest
import torch

from routeformer.attention import (
    Inputs,
    LinearOptions,
    MobaOptions,
    cross_routes,
    full_attention,
    linear_attention,
    moba_cross_attention,
    performer_attention,
    routing_cross_attention,
)
from routeformer.attention.moba import memory_blocks, moba_cross_mask
from routeformer.attention.performer import orthogonal_features, performer_features
from routeformer.attention.reference import reference_cross_attention
from routeformer.attention.routing.cross import routing_cross_mask
from routeformer.documents import CrossDocuments, documents_from_lengths
from test_cross import EXECUTORS, B, D, H, centroids, close  # the memory's shapes and tolerances of test_cross

SOURCES = [[9, 20, 1, 17], [30, 17]]  # each row's memory documents (Nk = 47), row 1 two of them
TARGETS = [[5, 11, 7, 14], [20, 17]]  # its query documents (Nq = 37), as many a row


def packed(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    nq, nk = sum(TARGETS[0]), sum(SOURCES[0])
    q = torch.randn(B, H, nq, D, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(B, H, nk, D, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    ids = CrossDocuments(documents_from_lengths(TARGETS) * 3 + 1, documents_from_lengths(SOURCES) + 5)  # any ids
    return q, k, v, ids


def same_document(ids: CrossDocuments) -> torch.Tensor:
    """(B, 1, Nq, Nk): query and key in the same document (the d-th run of ids on each side)."""
    runs = [torch.nn.functional.pad((x.diff(dim=-1) != 0).long().cumsum(-1), (1, 0)) for x in ids]
    return (runs[0][:, :, None] == runs[1][:, None, :])[:, None]


def padding(nk: int) -> torch.Tensor:
    mask = torch.ones(B, nk, dtype=torch.bool)
    mask[1, -5:] = False  # the last document of row 1 ends in padding
    mask[0, 12] = False  # and a hole in a document of row 0
    return mask


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("padded", [False, True])
def test_full_cross_reads_its_own_document_only(executor, padded):
    q, k, v, ids = packed()
    mask = padding(k.shape[2]) if padded else None
    x = Inputs.cross(q, k, v, key_padding_mask=mask, documents=ids)
    out = full_attention(x, None, executor, causal=False)
    ref = reference_cross_attention(Inputs.cross(q, k, v, key_padding_mask=mask), same_document(ids))
    close(out, ref, (q, k, v))
    torch.testing.assert_close(reference_cross_attention(x), ref, rtol=0, atol=0)  # the reference honours them


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("probes,clusters,window", [(1, 3, None), (2, 3, None), (2, 4, 6), (3, 5, 40)])
def test_routing_cross_reads_its_own_document_only(executor, padded, probes, clusters, window):
    q, k, v, ids = packed(1)
    mask = padding(k.shape[2]) if padded else None
    x = Inputs.cross(q, k, v, key_padding_mask=mask, documents=ids)
    routes = cross_routes(q, k, centroids(clusters), probes, key_padding_mask=mask,
                          documents=x.cross_documents.memory)
    out = routing_cross_attention(x, routes, window, executor)
    allowed = routing_cross_mask(routes, window, mask, ids)
    assert not bool((allowed & ~same_document(ids)).any())  # the definition itself keeps to the documents
    ref = reference_cross_attention(Inputs.cross(q, k, v, key_padding_mask=mask), allowed)
    close(out, ref, (q, k, v))


@pytest.mark.parametrize("kind", ["full", "routing"])
def test_each_document_is_scored_as_if_alone(kind):
    """Row 0's documents run one by one (their own queries and memory, no documents) give the packed row's rows."""
    q, k, v, ids = packed(2)
    mu = centroids(3)
    x = Inputs.cross(q, k, v, documents=ids)

    def attend(inputs, memory_ids=None):
        if kind == "full":
            return full_attention(inputs, None, "fused", causal=False)
        routes = cross_routes(inputs.q, inputs.k, mu, 2, documents=memory_ids)
        return routing_cross_attention(inputs, routes, None, "fused")

    out = attend(x, x.cross_documents.memory)
    qs = torch.tensor([0, *TARGETS[0]]).cumsum(0).tolist()
    ks = torch.tensor([0, *SOURCES[0]]).cumsum(0).tolist()
    for d in range(len(TARGETS[0])):
        alone = attend(Inputs.cross(q[:1, :, qs[d]:qs[d + 1]], k[:1, :, ks[d]:ks[d + 1]], v[:1, :, ks[d]:ks[d + 1]]))
        torch.testing.assert_close(out[:1, :, qs[d]:qs[d + 1]], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["full", "routing"])
def test_no_gradient_crosses_a_document(kind):
    q, k, v, ids = packed(3)
    x = Inputs.cross(q, k, v, documents=ids)
    if kind == "full":
        out = full_attention(x, None, "tiles", causal=False)
    else:
        out = routing_cross_attention(x, cross_routes(q, k, centroids(3), 2, documents=x.cross_documents.memory))
    out[0, :, :TARGETS[0][0]].sum().backward()  # row 0's first query document
    assert bool((k.grad[0, :, SOURCES[0][0]:] == 0).all()) and bool((v.grad[0, :, SOURCES[0][0]:] == 0).all())
    assert bool((k.grad[0, :, :SOURCES[0][0]] != 0).any())


def test_cross_documents_are_checked():
    q, k, v, ids = packed()
    with pytest.raises(ValueError, match="CrossDocuments"):
        Inputs.cross(q, k, v, documents=ids.queries)
    with pytest.raises(ValueError, match=r"documents.memory must have shape \(B, Nk\)"):
        Inputs.cross(q, k, v, documents=CrossDocuments(ids.queries, ids.memory[:, :-1]))
    with pytest.raises(ValueError, match="documents.queries must be an integer tensor"):
        Inputs.cross(q, k, v, documents=CrossDocuments(ids.queries.float(), ids.memory))
    backwards = ids.memory.clone()
    backwards[1] = backwards[1].flip(-1)
    with pytest.raises(ValueError, match=r"documents.memory must never decrease along a row \(.*\): row 1 goes"):
        Inputs.cross(q, k, v, documents=CrossDocuments(ids.queries, backwards))
    fewer = ids.memory.clone()
    fewer[0] = 0  # row 0: one memory document for four query documents
    with pytest.raises(ValueError, match="row 0 packs 4 query documents but 1 memory documents"):
        Inputs.cross(q, k, v, documents=CrossDocuments(ids.queries, fewer))
    one = CrossDocuments(torch.zeros_like(ids.queries), torch.full_like(ids.memory, 3))
    assert Inputs.cross(q, k, v, documents=one).cross_documents is None  # one a row: the plain path


PROJECTION = orthogonal_features(H, 16, D, generator=torch.Generator().manual_seed(3)).double()


def features_over(inputs, allowed):
    """Performer's estimator written densely: the weights φ(q)·φ(k) over the ``allowed`` (B, H, Nq, Nk) keys."""
    phi_q = performer_features(inputs.q, PROJECTION, inputs.scale, query=True)
    phi_k = performer_features(inputs.k, PROJECTION, inputs.scale, query=False)
    weights = (phi_q @ phi_k.transpose(-1, -2)) * allowed
    return weights / weights.sum(-1, keepdim=True) @ inputs.v


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("padded", [False, True])
def test_linear_and_performer_cross_read_their_own_document_only(executor, padded):
    """The feature maps' cross-attention over packed documents (a causal scan over each document's memory, then
    its queries) against the quadratic kernel form over the same document's real keys."""
    q, k, v, ids = packed(4)
    mask = padding(k.shape[2]) if padded else None
    x = Inputs.cross(q, k, v, key_padding_mask=mask, documents=ids)
    for kernel in ("elu", "poly2"):
        out = linear_attention(x, LinearOptions(kernel=kernel), executor, causal=False)
        close(out, reference_cross_attention(Inputs.cross(q, k, v, key_padding_mask=mask), same_document(ids),
                                             kernel=kernel), (q, k, v))
    out = performer_attention(x, None, executor, causal=False, projection=PROJECTION)
    allowed = same_document(ids) & (True if mask is None else mask[:, None, None, :])
    close(out, features_over(x, allowed), (q, k, v))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("options", [MobaOptions(block=4, top_k=2), MobaOptions(block=6, top_k=1, score="bound"),
                                     MobaOptions(block=50, top_k=1)])
def test_moba_cross_reads_its_own_documents_blocks(executor, padded, options):
    """Blocks counted from each memory document's start, a query choosing among its own document's: against
    ``moba_cross_mask`` (a (blocks, Nk) membership written from the document ids alone)."""
    q, k, v, ids = packed(5)
    mask = padding(k.shape[2]) if padded else None
    x = Inputs.cross(q, k, v, key_padding_mask=mask, documents=ids)
    out = moba_cross_attention(x, options, executor)
    allowed = moba_cross_mask(q, k, options, mask, x.cross_documents)
    assert not bool((allowed & ~same_document(ids)).any())
    if options.block < 50:  # a document of 17 or 20 keys has several blocks, and some are left out
        assert bool((same_document(ids) & ~allowed).any())
    close(out, reference_cross_attention(Inputs.cross(q, k, v, key_padding_mask=mask), allowed), (q, k, v))


def test_the_memory_blocks_start_at_each_document():
    """``memory_blocks`` on a row of documents of 5, 3 and 6 keys, blocks of 4: [0, 4) [4, 5) [5, 8) [8, 12)
    [12, 14); a second row of one document: [0, 4) [4, 8) [8, 12) [12, 14), then an empty block."""
    memory = torch.tensor([[0] * 5 + [1] * 3 + [2] * 6, [0] * 14])
    of, lo, hi = memory_blocks(torch.ones(2, 14, dtype=torch.bool), 4, memory)
    assert lo.tolist() == [[0, 4, 5, 8, 12], [0, 4, 8, 12, 14]]
    assert hi.tolist() == [[4, 5, 8, 12, 14], [4, 8, 12, 14, 0]]
    assert of[0].tolist() == [0] * 4 + [1] + [2] * 3 + [3] * 4 + [4] * 2


@pytest.mark.parametrize("kind", ["moba", "linear", "performer"])
def test_each_document_is_scored_as_if_alone_by_the_other_kinds(kind):
    q, k, v, ids = packed(6)
    attend = {"moba": lambda i: moba_cross_attention(i, MobaOptions(block=4, top_k=2), "fused"),
              "linear": lambda i: linear_attention(i, None, "fused", causal=False),
              "performer": lambda i: performer_attention(i, None, "fused", causal=False, projection=PROJECTION)}[kind]
    out = attend(Inputs.cross(q, k, v, documents=ids))
    qs = torch.tensor([0, *TARGETS[0]]).cumsum(0).tolist()
    ks = torch.tensor([0, *SOURCES[0]]).cumsum(0).tolist()
    for d in range(len(TARGETS[0])):
        alone = attend(Inputs.cross(q[:1, :, qs[d]:qs[d + 1]], k[:1, :, ks[d]:ks[d + 1]], v[:1, :, ks[d]:ks[d + 1]]))
        torch.testing.assert_close(out[:1, :, qs[d]:qs[d + 1]], alone, rtol=1e-12, atol=1e-12)


def test_routes_sorted_without_documents_are_refused_with_documents():
    q, k, v, ids = packed()
    x = Inputs.cross(q, k, v, documents=ids)
    plain = cross_routes(q, k, centroids(3), 1)  # sorted as one document a row
    with pytest.raises(ValueError, match="made without padding or documents, the inputs come with documents"):
        routing_cross_attention(x, plain)


@pytest.mark.parametrize("cross", [None, "moba:2,performer:1,linear:1"])
def test_a_model_scores_packed_pairs_as_if_each_were_alone(cross):
    """Seq2SeqLM with the shipped translator's sizes and heads (decoder local + full, cross routing + full,
    absolute positions, token shift) but an encoder of local + routing heads, and with MoBA, Performer and linear
    cross heads: a row of three packed pairs, with padding after the sources, gives each pair's logits as that pair
    alone does; and the sources' padding changes nothing."""
    import dataclasses

    from routeformer.model.seq2seq import Seq2SeqLM
    from routeformer.train.loading import load_run_config

    torch.manual_seed(0)
    config = load_run_config("translate").model
    routing = {"num_clusters": 4, "window": 8, "probes": 1, "balance": 0.0}  # the paper's balanced clusters
    config = dataclasses.replace(config, encoder=dataclasses.replace(
        config.encoder, attention="local:2,routing:2", options={**config.encoder.options, "routing": routing}))
    if cross is not None:  # MoBA's block given, so that it does not follow the packed row's length
        config = dataclasses.replace(config, cross=cross, cross_options={"moba": {"block": 4, "top_k": 2}})
    model = Seq2SeqLM(config).double().eval()
    torch.nn.init.normal_(model.head.weight)  # it starts at zero: every logit would be 0
    sources, targets = [9, 20, 14], [12, 7, 21]
    src = torch.randint(1, 256, (2, sum(sources) + 4))
    tgt = torch.randint(1, 256, (2, sum(targets)))
    pad = torch.ones_like(src, dtype=torch.bool)
    pad[:, -4:] = False  # four padded source positions at the end of each row
    ids = CrossDocuments(documents_from_lengths([targets] * 2), documents_from_lengths([sources[:-1] + [18]] * 2))
    out = model(src, tgt, pad, documents=ids)
    qs, ks = torch.tensor([0, *targets]).cumsum(0).tolist(), torch.tensor([0, *sources]).cumsum(0).tolist()
    for d in range(3):
        alone = model(src[:, ks[d]:ks[d + 1]], tgt[:, qs[d]:qs[d + 1]])
        torch.testing.assert_close(out[:, qs[d]:qs[d + 1]], alone, rtol=1e-10, atol=1e-10)
    other = src.clone()
    other[:, -4:] = 7  # what the padding holds
    torch.testing.assert_close(model(other, tgt, pad, documents=ids), out, rtol=0, atol=0)
