"""Seq2SeqLM (issue 73): an encoder of non-causal heads, a decoder with cross-attention heads of every cross kind;
no target position reads a later one, the source's padding changes nothing, every part learns, the k-means steps
of all three places run, and the configuration's errors name the problem."""

from __future__ import annotations

import pytest
import torch

from routeformer.model.seq2seq import Seq2SeqConfig, Seq2SeqLM

COMMON = dict(vocab_size=64, dim=32, heads=4, positions="absolute")
ROUTING = {"num_clusters": 4, "window": 12, "probes": 1, "balance": 0.0}


def config(cross: str = "routing:1,full:1,moba:1,linear:1", **changes) -> Seq2SeqConfig:
    fields = dict(
        encoder=dict(COMMON, depth=2, seq_len=40, attention="local:2,routing:2",
                     options={"local": {"window": 8}, "routing": ROUTING}),
        decoder=dict(COMMON, depth=2, seq_len=32, attention="local:2,routing:2",
                     options={"local": {"window": 8}, "routing": {"num_clusters": 4}}),
        cross=cross, cross_options={"routing": {"num_clusters": 5, "probes": 2}, "moba": {"block": 6, "top_k": 2}})
    fields.update(changes)
    return Seq2SeqConfig(**fields)


def model(cross: str = "routing:1,full:1,moba:1,linear:1") -> Seq2SeqLM:
    torch.manual_seed(0)
    m = Seq2SeqLM(config(cross)).double()
    for p in m.parameters():  # the head starts at zero: give every path a say in the logits
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else None
    return m


def tokens(seed: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cross", ["routing:4", "full:2,moba:2", "linear:2,performer:2"])
def test_no_target_position_reads_a_later_one(cross) -> None:
    m = model(cross).eval()
    source, target = tokens(1, (2, 40)), tokens(2, (2, 32))
    later = target.clone()
    later[:, 20:] = tokens(3, (2, 12))
    a, b = m(source, target), m(source, later)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-12)  # an ulp: routing's tiles move
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_the_source_padding_changes_nothing() -> None:
    m = model().eval()
    source, target = tokens(4, (2, 40)), tokens(5, (2, 32))
    padding = torch.ones(2, 40, dtype=torch.bool)
    padding[1, 29:] = False  # the second source is 29 tokens; the rest is garbage
    both = m(source, target, padding)
    alone = m(source[1:, :29], target[1:])
    torch.testing.assert_close(both[1], alone[0], rtol=1e-10, atol=1e-10)


def test_every_part_learns_and_every_stack_routes() -> None:
    m = model("routing:2,full:1,performer:1").train()
    source, target = tokens(6, (2, 40)), tokens(7, (2, 32))
    logits = m(source, target[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target[:, 1:].flatten()) + m.aux_loss
    loss.backward()
    silent = [name for name, p in m.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not silent, silent
    assert float(m.aux_loss.detach()) > 0  # the commitment terms of the encoder's, decoder's and cross heads' routing
    assert m.after_optimizer_step() == 6  # two layers of each: the encoder's, the decoder's and the cross routing
    state = m.replicated_state()
    for where in ("encoder.0.attention.groups.1", "decoder.1.attention.groups.1", "decoder.1.cross.groups.0"):
        assert any(key.startswith(where) and key.endswith("centroids") for key in state), where


def test_the_configuration_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="cross: unknown kind 'local'; cross-attention kinds: full, routing, moba"):
        config("local:4")
    with pytest.raises(ValueError, match=r"encoder.dim \(48\) and decoder.dim \(32\) must be equal"):
        config(encoder=dict(COMMON, dim=48, depth=1, seq_len=40, attention="full"))
    with pytest.raises(ValueError, match=r"cross_options: unknown section\(s\) \['lsh'\]"):
        config(cross_options={"lsh": {}})
    with pytest.raises(ValueError, match="cross.options.moba: .*top_k"):
        config(cross_options={"moba": {"top_k": 0}})
    with pytest.raises(ValueError, match="encoder: moba heads have no non-causal"):
        Seq2SeqLM(config(encoder=dict(COMMON, depth=1, seq_len=40, attention="local:2,moba:2",
                                      options={"local": {"window": 8}})))
    m = model()
    with pytest.raises(ValueError, match=r"source_padding must be a \(B, Ns\)"):
        m(tokens(1, (2, 40)), tokens(2, (2, 32)), torch.ones(2, 39, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"target: token ids must lie in \[0, 64\)"):
        m(tokens(1, (2, 40)), torch.full((2, 3), 64))
