"""Seq2SeqLM (issue 73): an encoder of non-causal heads, a decoder with cross-attention heads of every cross kind;
no target position reads a later one, the source's padding changes nothing, every part learns, the k-means steps
of all three places run, and the configuration's errors name the problem."""

from __future__ import annotations

import pytest
import torch

from routeformer.model.seq2seq import Sampling, Seq2SeqConfig, Seq2SeqLM

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
    with pytest.raises(ValueError, match=r"target: token ids must lie in \[0, vocab_size=64\), got values in \[64, 64\]"):
        m(tokens(1, (2, 40)), torch.full((2, 3), 64))


@pytest.mark.parametrize("cross", ["routing:1,full:1,moba:1,performer:1", "linear:2,performer:2"])
@pytest.mark.parametrize("padded", [False, True])
def test_decoding_reproduces_the_forward(padded, cross) -> None:
    """Target tokens fed one at a time (then four at once) through the cache: the forward's logits, every cross kind,
    the source encoded and routing's memory sorted once."""
    m = model(cross).eval()
    source, target = tokens(8, (2, 40)), tokens(9, (2, 32))
    padding = None
    if padded:
        padding = torch.ones(2, 40, dtype=torch.bool)
        padding[0, 33:] = False
    whole = m(source, target, padding)
    cache = m.start_decoding(source, padding)
    steps = [m.decode(target[:, t:t + 1], cache) for t in range(28)] + [m.decode(target[:, 28:], cache)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="max_len: 33 target positions exceed the cache's max_len=32"):
        m.decode(target[:, :1], cache)


def test_translate_greedy_matches_the_forward_and_sampling_repeats() -> None:
    m = model().eval()
    source = tokens(10, (2, 40))
    out = m.translate(source, 12, stop=None)
    assert out.shape == (2, 12)
    inputs = torch.cat([torch.zeros(2, 1, dtype=torch.long), out[:, :-1]], 1)  # the start token, then its own
    assert torch.equal(m(source, inputs).argmax(-1), out)  # greedy: each token the forward's argmax
    a, b = (m.translate(source, 12, sampling=Sampling(1.0, top_k=8, seed=3), stop=None) for _ in range(2))
    assert torch.equal(a, b)
    stop = int(out[0, 2])
    stopped = m.translate(source, 12, stop=stop)
    for row in range(2):
        hits = (out[row] == stop).nonzero().flatten().tolist()
        end = hits[0] + 1 if hits else 12  # greedy's tokens up to its first stop, then the stop token again
        assert torch.equal(stopped[row, :end], out[row, :end])
        assert bool((stopped[row, end:] == stop).all())
    assert stopped.shape[1] == max(((out[r] == stop).nonzero().flatten().tolist() or [11])[0] + 1 for r in range(2))


def test_save_and_load_give_the_same_model(tmp_path) -> None:
    m = model().float()  # the dtype a model is built in: the file's values load exactly
    source, target = tokens(11, (2, 40)), tokens(12, (2, 32))
    m.train()
    m(source, target)  # the k-means of all three places see data, then their first step seeds them
    m.after_optimizer_step()
    m.eval()
    m.save_pretrained(tmp_path / "s2s")
    back = Seq2SeqLM.from_pretrained(tmp_path / "s2s").eval()
    assert back.config.cross == m.config.cross and back.config.cross_options == m.config.cross_options
    torch.testing.assert_close(back(source, target), m(source, target), rtol=0, atol=0)
    (tmp_path / "s2s" / "config.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="not an encoder-decoder config"):
        Seq2SeqLM.from_pretrained(tmp_path / "s2s")


def _ranks_worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    m = model("routing:2,full:2").float().train()  # the same initial state on every rank
    for step in range(3):
        source, target = tokens(100 * rank + step, (2, 40)), tokens(50 + 100 * rank + step, (2, 32))
        m(source, target)  # each rank its own batch: its own k-means statistics
        m.after_optimizer_step()
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: v.clone() for k, v in m.replicated_state().items()})
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()


def test_two_gloo_ranks_keep_every_stacks_centroids_bit_identical(tmp_path) -> None:
    import torch.multiprocessing as mp

    out = str(tmp_path / "state.pt")
    mp.spawn(_ranks_worker, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True)
    a, b = torch.load(out)
    places = {key.split(".")[0] + (".cross" if ".cross." in key else "") for key in a}
    assert places == {"encoder", "decoder", "decoder.cross"}  # the encoder's, the decoder's and the cross routing
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between ranks"
    seeded = {k: bool(v) for k, v in a.items() if k.endswith("initialized")}
    assert len(seeded) == 6 and all(seeded.values()), seeded  # every place's k-means stepped (two layers each)


def test_feature_cross_heads_decode_from_the_memorys_sums_alone() -> None:
    """Linear and Performer cross heads keep Σ φ(k) vᵀ and Σ φ(k) of the memory: a decoded token reads neither the
    memory's keys nor its values (here replaced by NaN after they were summed)."""
    m = model("linear:2,performer:2").eval()
    source, target = tokens(13, (2, 40)), tokens(14, (2, 32))
    whole = m(source, target)
    cache = m.start_decoding(source)
    for kept in cache.memory:
        kept.keys = [torch.full_like(k, float("nan")) for k in kept.keys]
        kept.values = [torch.full_like(v, float("nan")) for v in kept.values]
    steps = torch.cat([m.decode(target[:, t:t + 1], cache) for t in range(32)], 1)
    torch.testing.assert_close(steps, whole, rtol=1e-10, atol=1e-10)
