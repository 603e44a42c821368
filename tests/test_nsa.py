"""The NSA-style kind (``attention/nsa.py``): the generic checks, the forward and every gradient (q, k, v, the
relative tables, the compression weights and the gates) against its dense definition on every CPU executor, no leak
through a model, decoding equal to the forward, the learned parts trained, the cost, the options, and a broken
selection caught by the reference check.

The heads' initial parameters (mean compression, every gate 0.5, no gradient into the gates' weights through a
zero) would hide errors, so most tests draw them at random (``randomised``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import rand_qkv, rand_rel
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import nsa
from routeformer.attention.blocks import NONE, candidate_blocks, select_blocks, selected_mask
from routeformer.attention.moba import default_block
from routeformer.attention.nsa import NsaHeads, NsaOptions
from routeformer.attention.registry import get_kind
from routeformer.executors import get_executor
from routeformer.testing import check_kind

SMALL = {"block": 5, "top": 2, "window": 6}
LEARNED = ("key_weights", "value_weights", "gate_weight", "gate_bias")


def randomised(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every NSA group's compression weights and gates drawn at random (in place); returns the module."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for group in module.modules():
            if isinstance(group, NsaHeads):
                for name in LEARNED:
                    p = getattr(group, name)
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if name == "gate_weight" else 1))
    return module


def heads(executor: str = "tiles", **options) -> NsaHeads:
    group = NsaHeads(2, 8, NsaOptions(**{**SMALL, **options})).double()
    group.executor = get_executor(executor)
    return randomised(group)


def model(attention: str = "nsa", n: int = 40, backend: str = "auto", **options) -> TransformerLM:
    config = TransformerConfig(vocab_size=23, dim=32, depth=2, heads=4, seq_len=n, attention=attention, rel_clip=6,
                               options={"nsa": {**SMALL, **options}, "local": {"window": 6}}
                               if "local" in attention else {"nsa": {**SMALL, **options}}, backend=backend)
    torch.manual_seed(0)
    lm = TransformerLM(config).double()
    with torch.no_grad():  # the paper's init zeroes the logit weights: nothing would reach the output
        lm.head.weight.normal_(std=0.5)
    return randomised(lm).eval()


def tokens(n: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 23, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n, positions, options", [
    (40, "relative", {}),
    (40, "absolute", {}),
    (40, "none", {"top": 3}),
    (40, "relative", {"warmup": 1}),
    (43, "relative", {"block": 6}),  # blocks that do not divide N: 7 whole blocks and one of 1
    (37, "relative", {"block": 4, "top": 1, "window": 3}),
    (40, "relative", {"block": None, "window": None}),  # the defaults: block sqrt(N) for top 2, window = block
])
def test_the_generic_checks_pass(n: int, positions: str, options: dict) -> None:
    report = check_kind("nsa", seq_len=n, positions=positions, rel_clip=8, options={"nsa": {**SMALL, **options}})
    assert max(report.reference, report.reference_grad, report.leak, report.decode) <= 1e-9


@pytest.mark.parametrize("executor", ["tiles", "fused", "flex"])
@pytest.mark.parametrize("n, relative", [(40, True), (43, True), (43, False), (4, True)])
def test_forward_and_gradients_equal_the_definition_on_every_executor(executor: str, n: int, relative: bool) -> None:
    """Float64, random parameters: outputs and the gradients of q, k, v, the relative tables, the compression
    weights and the gates (n = 4: shorter than a block, no compressed block and no selection)."""
    group = heads(executor)
    q, k, v = rand_qkv(2, 2, n, 8)
    rel = rand_rel(8, 4) if relative else None
    leaves = [q, k, v] + ([rel.key, rel.value] if rel is not None else []) + [getattr(group, p) for p in LEARNED]
    results = []
    for attend in (group, group.reference):
        out = attend(q, k, v, rel)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        results.append((out, torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    names = ["q", "k", "v"] + (["a^K", "a^V"] if rel is not None else []) + list(LEARNED)
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert got is not None and want is not None, f"no gradient of {name}"
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
    if n > SMALL["block"]:  # the compressed branch is there: its weights learn
        assert all(g.abs().sum() > 0 for g in grads[-4:])


@pytest.mark.parametrize("executor", ["tiles", "fused"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_selection_scored_in_chunks_is_the_whole_ones(monkeypatch, executor: str, packed: bool) -> None:
    """Queries scored a few at a time (``SELECT_CHUNK`` small: one query a chunk, then 3): the same output and
    gradients as all at once, with and without packed documents (the partial first block's own score in every
    chunk)."""
    from routeformer.documents import documents_from_lengths

    group = heads(executor)
    q, k, v = rand_qkv(2, 2, 43, 8)
    documents = documents_from_lengths([[7, 1, 20, 15], [43]]) if packed else None
    results = []
    for chunk in (1 << 22, 1, 3 * 2 * 2 * 8):  # all at once; one query a chunk; three (43 // 5 = 8 blocks)
        monkeypatch.setattr(nsa, "SELECT_CHUNK", chunk)
        out = group(q, k, v, None, documents=documents)
        results.append((out, *torch.autograd.grad(out.square().sum(), [q, k, v])))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_no_tensor_holds_every_query_against_every_compressed_block(monkeypatch) -> None:
    """A forward and backward (fused executor, N = 1024, blocks of 8: 128 compressed blocks) makes no tensor of
    B · h · N · N / block elements, nor a quarter of one: the compressed branch runs as ranges (the backward keeps
    no weights) and the selection scores chunks of queries."""
    from helpers import OperatorCount

    B, h, N, D, b = 1, 2, 1024, 8, 8
    group = NsaHeads(h, D, NsaOptions(block=b, top=2, window=8)).double()
    group.executor = get_executor("fused")
    q, k, v = rand_qkv(B, h, N, D)
    monkeypatch.setattr(nsa, "SELECT_CHUNK", 1 << 14)
    with OperatorCount() as count:
        out = group(q, k, v, None)
        out.square().sum().backward()
    assert count.largest < B * h * N * (N // b) // 4, count.largest


def test_the_definitions_selection_is_select_blocks() -> None:
    """The reference's selection by rank (chosen when fewer than ``top`` candidates score higher) and the fast
    path's ``select_blocks`` give the same pattern under ``selected_mask``."""
    n, block, top = 43, 5, 2
    scores = torch.randn(2, 3, n, n // block, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    allowed = candidate_blocks(torch.arange(n), n // block, block)
    higher = ((scores[..., None, :] > scores[..., :, None]) & allowed[:, None, :]).sum(-1)
    chosen = torch.where(allowed & (higher < top), torch.arange(n // block), NONE)
    assert torch.equal(selected_mask(chosen, block), selected_mask(select_blocks(scores, block, top), block))


def test_a_selection_of_the_lowest_scores_is_caught(monkeypatch) -> None:
    """Selection by the lowest compressed scores (a broken ``select_blocks`` in the forward and the decoding step)
    still leaks nothing and decodes like its forward: only the reference check, whose selection is its own, sees it."""
    monkeypatch.setattr(nsa, "select_blocks", lambda scores, *args, **kw: select_blocks(-scores, *args, **kw))
    with pytest.raises(AssertionError, match="nsa heads fail the reference check"):
        check_kind("nsa", seq_len=40, rel_clip=8, options={"nsa": SMALL})


def test_a_compressed_branch_that_sees_its_own_block_is_caught(monkeypatch) -> None:
    """Compressed attention to the query's own block (complete or not) is a leak: the leak check sees it."""
    monkeypatch.setattr(nsa, "compressed_end", lambda pos, block: (pos + block) // block)
    with pytest.raises(AssertionError, match="nsa heads fail the (reference|leak) check"):
        check_kind("nsa", seq_len=40, rel_clip=8, options={"nsa": SMALL})


@pytest.mark.parametrize("backend", ["tiles", "fused", "flex"])
def test_changing_the_future_changes_no_past_logit(backend: str) -> None:
    lm = model("local:2,nsa:2", backend=backend)
    x = tokens(40)
    with torch.no_grad():
        before = lm(x)
        for t in (3, 17, 31):  # inside the first block, mid-block, the last whole block
            y = x.clone()
            y[:, t + 1:] = (y[:, t + 1:] + 7) % 23
            after = lm(y)
            torch.testing.assert_close(after[:, :t + 1], before[:, :t + 1], rtol=0, atol=1e-12)
            assert not torch.allclose(after[:, t + 1:], before[:, t + 1:])


@pytest.mark.parametrize("backend", ["tiles", "fused", "flex"])
def test_decoding_equals_the_forward(backend: str) -> None:
    """A prompt that ends mid-block, then one token at a time across every block boundary, then a chunk; and
    greedy generation follows the forward's argmax."""
    lm = model(n=48, backend=backend)
    x = tokens(48)
    with torch.no_grad():
        full = lm(x)
        for prompt in (1, 7):
            cache = lm.new_cache(2, 48)
            parts = [lm(x[:, :prompt], cache)] + [lm(x[:, t:t + 1], cache) for t in range(prompt, 44)]
            parts.append(lm(x[:, 44:], cache))
            torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-10)
        out = lm.generate(x[:, :6], 30, temperature=0)
        assert torch.equal(lm(out[:, :-1])[:, 5:].argmax(-1), out[:, 6:])


def test_the_gates_and_the_compression_learn() -> None:
    """A training step's loss reaches the compression weights and the gates' weights and biases of every layer
    (at their initial values: mean compression, every gate 0.5), and an optimiser step moves them."""
    config = TransformerConfig(vocab_size=23, dim=32, depth=2, heads=2, seq_len=40, attention="nsa", rel_clip=6,
                               options={"nsa": SMALL})
    torch.manual_seed(0)
    lm = TransformerLM(config)
    with torch.no_grad():
        lm.head.weight.normal_(std=0.5)
    x = tokens(41)
    F.cross_entropy(lm(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    groups = [g for g in lm.head_groups() if isinstance(g, NsaHeads)]
    assert len(groups) == 2
    before = {(i, name): getattr(g, name).detach().clone() for i, g in enumerate(groups) for name in LEARNED}
    for g in groups:
        for name in LEARNED:
            grad = getattr(g, name).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    torch.optim.SGD(lm.parameters(), lr=0.1).step()
    assert all(not torch.equal(getattr(g, name), before[i, name]) for i, g in enumerate(groups) for name in LEARNED)


def test_the_warm_up_is_full_attention_then_the_branches() -> None:
    """During the warm-up the heads are full causal attention (the gates unused); after ``warmup`` optimiser steps
    they select. The step count is saved with the model and read back."""
    group = heads(warmup=2)
    q, k, v = rand_qkv(1, 2, 40, 8, grad=False)
    full = get_kind("full").build(get_kind("full").read_options({}), 2, 8, 0).double()
    for step in range(2):
        assert group.warming_up
        torch.testing.assert_close(group(q, k, v, None), full(q, k, v, None), rtol=0, atol=1e-12)
        assert group.after_optimizer_step(step, None)
    assert not group.warming_up and not group.after_optimizer_step(2, None)
    assert not torch.allclose(group(q, k, v, None), full(q, k, v, None))
    fresh = heads(warmup=2)
    fresh.load_state_dict(group.state_dict())
    assert not fresh.warming_up and int(fresh.steps) == 2


def test_keys_per_query_counts_every_branch() -> None:
    """Against a count per query position: the compressed blocks before its own, its selected blocks, its own
    block up to itself and the window, averaged; the warm-up costs every earlier key."""
    kind, n = get_kind("nsa"), 40
    config = TransformerConfig(dim=32, heads=4, seq_len=n, attention="nsa", rel_clip=6,
                               options={"nsa": {**SMALL, "warmup": 3}})
    o = config.options["nsa"]
    i = torch.arange(n, dtype=torch.float64)
    blocks = torch.div(i, 5, rounding_mode="floor")
    want = (blocks + blocks.clamp(max=2) * 5 + (i % 5 + 1) + (i + 1).clamp(max=6)).mean().item()
    assert kind.keys_per_query(o, n) == pytest.approx(want)
    assert kind.cost(o, n, step=0) == (n + 1) / 2 and kind.cost(o, n, step=3) == pytest.approx(want)
    assert config.keys_per_query() == {"nsa": pytest.approx(want)}
    assert kind.describe_options(o) == "block=5, top=2, window=6, warm-up=3"


def test_options_are_completed_and_checked_by_name() -> None:
    config = TransformerConfig(dim=32, heads=4, seq_len=256, attention="nsa")
    o = config.options["nsa"]
    assert (o.block, o.top, o.window, o.warmup_len) == (default_block(256, 2), 2, 16, None) and o.block == 16
    assert config.options == TransformerConfig.from_dict(config.to_dict()).options
    for options, message in [({"window": 300}, r"options.nsa: window \(300\) is larger than seq_len \(256\)"),
                             ({"block": 300}, r"options.nsa: block \(300\) is larger than seq_len \(256\)"),
                             ({"top": 0}, r"options.nsa: top must be a positive integer"),
                             ({"warmup": -1}, r"options.nsa: warmup must be a non-negative integer"),
                             ({"warmup": 5, "warmup_len": 100}, r"options.nsa: warmup_len \(100\) must divide"),
                             ({"topk": 2}, r"options.nsa: unknown field\(s\) \['topk'\]")]:
        with pytest.raises(ValueError, match=message):
            TransformerConfig(dim=32, heads=4, seq_len=256, attention="nsa", options={"nsa": options})
