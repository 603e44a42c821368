"""The device tests (marker ``cuda``): what a GPU user runs, on the device ``ROUTEFORMER_TEST_DEVICE`` names.

Default cuda (skipped where PyTorch sees no GPU); ``cpu`` runs the same tests through FlexAttention's dense eager
operator, so that they cannot rot on a machine without one (``tests/helpers.device_under_test``):

    ROUTEFORMER_TEST_DEVICE=cuda python -m pytest -m cuda tests/test_cuda.py     # on a GPU
    ROUTEFORMER_TEST_DEVICE=cpu python -m pytest -m cuda tests/test_cuda.py      # anywhere

On the device, in float32 with the executor ``auto`` picks there (flex; on the CPU flex asked for by name): every
kind of head in a small model against the same model in float64 on the CPU (the tiles executor), forward and
gradients, over rows of one sequence and of packed documents; causal routing with the paper's rule (one probe) and
with two probes, balanced (non-causal) routing, LSH, the routing warm-up and hand-over, each against its dense
definition in float64 on the CPU over the routes the device computed (float32 and float64 may route a near tie
differently); relative positions; training steps;
decoding; bfloat16; ``compile = true``; and, on CUDA, no host synchronisation inside a training step's forward and
backward; new data causes no recompilation. scripts/device_check.py runs them first.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from helpers import DeviceUnderTest, rand_qkv, rand_rel, routing_layer
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import KINDS, Inputs, LSHOptions, lsh_attention, reference_attention
from routeformer.attention.lsh import default_lsh_settings, lsh_mask, lsh_rotations
from routeformer.documents import documents_from_lengths
from routeformer.executors import resolve_backend

pytestmark = pytest.mark.cuda

HEAD_DIM = 32


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-3, floor: float = 0.0) -> None:
    """``got`` equals ``want`` (each on any device, in any dtype; compared in float64 on the CPU) within ``rtol`` of
    want's largest entry, plus ``floor`` (for a gradient that is zero in exact arithmetic, such as the keys' bias:
    float32 rounding there)."""
    got, want = (x.detach().to("cpu", torch.float64) for x in (got, want))
    assert torch.isfinite(got).all(), f"{what}: not finite"
    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale + floor, msg=lambda m: f"{what}: {m}")


def _kind_config(name: str, n: int, backend: str) -> TransformerConfig:
    """A two-layer model of heads of kind ``name`` at length n, with settings that span several blocks of n."""
    window = n // 8
    options = {"local": {"window": window}, "longformer": {"window": n // 16, "global_tokens": [0, n // 3]},
               "strided": {"stride": round(n ** 0.5)}, "fixed": {"block": window, "summary": 4},
               "routing": {"num_clusters": 4, "window": window}, "moba": {"block": window, "top_k": 2},
               "nsa": {"block": window, "top": 2, "window": window}}
    kind = KINDS[name]
    options = {key: table for key, table in options.items() if key == kind.options_key}
    relative = kind.relative_positions is not False
    cfg = TransformerConfig(vocab_size=64, dim=2 * HEAD_DIM, depth=2, heads=2, seq_len=n, attention=name,
                            positions="relative" if relative else "absolute", rel_clip=32, options=options)
    if not _on_executor(cfg):  # linear, Performer, the kernels: one implementation of their own, no backend
        return cfg
    return dataclasses.replace(cfg, backend=backend)


def _pair(cfg: TransformerConfig, dut: DeviceUnderTest) -> tuple[TransformerLM, TransformerLM]:
    """The model on the device (float32, ``cfg``'s backend) and the same weights in float64 on the CPU (tiles)."""
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    with torch.no_grad():  # the paper's init zeroes the logit weights: nothing would reach the output
        model.head.weight.normal_(std=0.5)
    ref_cfg = dataclasses.replace(cfg, backend="tiles") if _on_executor(cfg) else cfg
    ref = TransformerLM(ref_cfg).double()
    ref.load_state_dict(model.state_dict())
    return model.to(dut.device), ref


def _on_executor(cfg: TransformerConfig) -> bool:
    return any(g.kind.runs_on_executor(g.options) for layer in cfg.head_groups() for g in layer)


def _tokens(cfg: TransformerConfig, batch: int = 2, seed: int = 1, extra: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + extra), generator=torch.Generator().manual_seed(seed))


def test_auto_is_flex_on_cuda(on_device: DeviceUnderTest) -> None:
    assert resolve_backend(on_device.backend, on_device.device) == "flex"
    layer = routing_layer(2, HEAD_DIM, 4, 16).to(on_device.device)
    if on_device.cuda:  # a standalone layer takes its device's executor
        assert layer.executor.name == "flex"


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_in_a_model_matches_float64_on_the_cpu(on_device: DeviceUnderTest, name: str) -> None:
    """Logits and every parameter's gradient of a small model of the kind's heads (evaluation mode: the routing
    and LSH state fixed), on the device in float32, against the same weights in float64 on the CPU."""
    cfg = _kind_config(name, on_device.model_n, on_device.backend)
    model, ref = _pair(cfg, on_device)
    model.eval()
    ref.eval()
    tokens = _tokens(cfg)
    logits, want = model(tokens.to(on_device.device)), ref(tokens)
    _close(logits, want, f"{name}: logits")
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (logits * weights.to(logits)).sum().backward()
    (want * weights).sum().backward()
    _same_gradients(model, ref, name)


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_over_packed_documents_matches_float64_on_the_cpu(on_device: DeviceUnderTest, name: str) -> None:
    """The same over rows of packed documents (issue 71): on flex, the documents' block tables narrowed from the
    pattern's own (``flex.blocks``), each row cut differently, one boundary inside a block of 128."""
    cfg = _kind_config(name, on_device.model_n, on_device.backend)
    model, ref = _pair(cfg, on_device)
    model.eval()
    ref.eval()
    n = cfg.seq_len
    documents = documents_from_lengths([[n // 4 - 3, n // 2, n - n // 4 - n // 2 + 3], [5, n - 5]])
    tokens = _tokens(cfg)
    logits = model(tokens.to(on_device.device), documents=documents.to(on_device.device))
    want = ref(tokens, documents=documents)
    _close(logits, want, f"{name} over documents: logits")
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (logits * weights.to(logits)).sum().backward()
    (want * weights).sum().backward()
    _same_gradients(model, ref, f"{name} over documents")


def _same_gradients(model: torch.nn.Module, ref: torch.nn.Module, what: str) -> None:
    """Every parameter's gradient of ``model`` equals ``ref``'s (float64 or not), within 1e-3 of its largest entry
    and 1e-5 of the largest entry of any (a gradient zero in exact arithmetic is float32 rounding)."""
    largest = max(float(r.grad.abs().max()) for r in ref.parameters() if r.grad is not None)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if r.grad is None:
            assert p.grad is None or not p.grad.any(), f"{what}: {name} has a gradient on the device only"
            continue
        assert p.grad is not None, f"{what}: no gradient reaches {name} on the device"
        _close(p.grad, r.grad, f"{what}: gradient of {name}", floor=1e-5 * largest)


# --- routing, LSH, the warm-up and the hand-over, against their dense definitions -------------------------------

def _routing(dut: DeviceUnderTest, **options):
    """A routing layer (2 heads, 4 clusters, window n / 8) in float32 on the device; the executor "auto" picks
    there, or the one named."""
    layer = routing_layer(2, HEAD_DIM, 4, dut.n // 8, backend=None if dut.backend == "auto" else dut.backend,
                          **options)
    return layer.to(dut.device)


def _qkv(dut: DeviceUnderTest, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(q, k, v) in float32 on the device, leaves; and the same values in float64 on the CPU, leaves."""
    base = rand_qkv(1, 2, dut.n, HEAD_DIM, seed=seed, grad=False)
    return ([x.to(dut.device, torch.float32).requires_grad_() for x in base],
            [x.clone().requires_grad_() for x in base])


def _rel(dut: DeviceUnderTest, rel: bool):
    if not rel:
        return None, None
    table = rand_rel(HEAD_DIM, 32)
    return copy.deepcopy(table).to(dut.device, torch.float32), table  # Module.to converts in place


def _compare(out: torch.Tensor, want: torch.Tensor, inputs: list[torch.Tensor], ref_inputs: list[torch.Tensor],
             what: str) -> None:
    """Forward and the gradients of ``inputs`` (device) against ``ref_inputs`` (float64, CPU)."""
    _close(out, want, f"{what}: output")
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad(out, inputs, grad.to(out), allow_unused=True)
    expected = torch.autograd.grad(want, ref_inputs, grad, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert (a is None) == (b is None), f"{what}: gradient {i} exists on one side only"
        if a is not None:
            _close(a, b, f"{what}: gradient {i}")


def _rel_leaves(rel) -> list[torch.Tensor]:
    return [] if rel is None else [rel.key, rel.value]


def _against_definition(layer, dut: DeviceUnderTest, rel: bool, what: str, seed: int = 0) -> None:
    """The layer's forward on the device against ``reference_attention`` in float64 on the CPU over the mask (and
    the hand-over's bias) the layer's own definition gives for the routes computed on the device."""
    (q, _, v), (q64, _, v64) = _qkv(dut, seed)
    rel_dev, rel64 = _rel(dut, rel)
    out = layer(q, q, v, rel_pos=rel_dev)
    with torch.no_grad():
        mask = layer.reference_mask(q, q).cpu()
        bias = layer.reference_bias(q, q)
    want = reference_attention(Inputs.of(q64, q64, v64), mask, rel=rel64,
                               bias=None if bias is None else bias.to("cpu", torch.float64))
    _compare(out, want, [q, v, *_rel_leaves(rel_dev)], [q64, v64, *_rel_leaves(rel64)], what)


@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("probes, balance", [(1, 0.0), (2, 0.01)], ids=["paper-rule", "two-probes"])
def test_causal_routing_matches_its_definition(on_device: DeviceUnderTest, probes: int, balance: float,
                                               rel: bool) -> None:
    layer = _routing(on_device, probes=probes, balance=balance)
    if balance:  # a bias as training leaves it: large enough to move assignments
        with torch.no_grad():
            layer.routing.bias.normal_(0, 0.5, generator=torch.Generator(device=on_device.device).manual_seed(0))
    layer.train()
    _against_definition(layer, on_device, rel, f"routing, {probes} probe(s)")


@pytest.mark.parametrize("rel", [False, True])
def test_balanced_routing_matches_its_definition(on_device: DeviceUnderTest, rel: bool) -> None:
    layer = _routing(on_device, causal=False, balanced=True).train()
    _against_definition(layer, on_device, rel, "balanced routing")


def test_the_warm_up_and_the_hand_over_match_their_definitions(on_device: DeviceUnderTest) -> None:
    """One warm-up step (dense), two hand-over steps (dense, the unrouted keys penalised), then routed; with
    relative positions and shared QK, as a model's routing heads have them."""
    layer = _routing(on_device, probes=2, balance=0.01, warmup=1, handover=2).train()
    phases = []
    for step in range(4):
        phases.append("warm-up" if layer.warming_up else "hand-over" if layer.handing_over else "routed")
        _against_definition(layer, on_device, True, f"step {step} ({phases[-1]})", seed=step)
        layer.update()
    assert phases == ["warm-up", "hand-over", "hand-over", "routed"]


def test_lsh_matches_its_definition(on_device: DeviceUnderTest) -> None:
    n = on_device.n
    buckets, window = default_lsh_settings(n)
    rotations = lsh_rotations(2, HEAD_DIM, buckets, 2)
    kw = {"buckets": buckets, "rounds": 2, "window": window, "causal": True}
    (q, _, v), (q64, _, v64) = _qkv(on_device)
    out = lsh_attention(Inputs.of(q, q, v), LSHOptions(buckets, 2, window), on_device.backend,
                        rotations=rotations.to(on_device.device))
    with torch.no_grad():
        mask = lsh_mask(q, **kw, rotations=rotations.to(on_device.device)).cpu()
    want = reference_attention(Inputs.of(q64, F.normalize(q64, dim=-1), v64), mask)
    _compare(out, want, [q, v], [q64, v64], "lsh")


# --- models: training, decoding, bfloat16, compile ---------------------------------------------------------------

def _model_config(dut: DeviceUnderTest, **routing) -> TransformerConfig:
    """Half local, half routing heads (the library's rule: two probes and a bias), relative positions."""
    n = dut.model_n
    return TransformerConfig(vocab_size=64, dim=4 * HEAD_DIM, depth=2, heads=4, seq_len=n, rel_clip=32,
                             attention="local:2,routing:2", backend=dut.backend,
                             options={"local": {"window": n // 8},
                                      "routing": {"num_clusters": 4, "window": n // 8, **routing}})


def _model(dut: DeviceUnderTest, **routing) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(_model_config(dut, **routing))
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
    return model.to(dut.device)


def _step(model, core: TransformerLM, tokens: torch.Tensor, opt: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """One training step of ``model`` (``core`` or its compiled form) on (B, N + 1) ``tokens``; returns the loss
    (not read on the host here)."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) + core.aux_loss.float()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
        core.after_optimizer_step()
    return loss.detach()


@pytest.mark.parametrize("phases", [{"warmup": 2}, {"warmup": 2, "handover": 2}], ids=["warm-up", "hand-over"])
def test_training_steps_are_finite_and_the_loss_falls(on_device: DeviceUnderTest, phases: dict) -> None:
    """Eight AdamW steps on one batch through the routing's dense warm-up (and hand-over), then routed steps."""
    model = _model(on_device, **phases).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = _tokens(model.config, extra=1).to(on_device.device)
    losses = [float(_step(model, model, tokens, opt)) for _ in range(8)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.9 * losses[0], losses
    group = model.head_groups()[1]
    assert not group.warming_up and not group.handing_over  # the last steps were routed
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_decoding_reproduces_the_forward(on_device: DeviceUnderTest) -> None:
    """A prompt of all but 48 positions, then one token at a time: the forward's logits (routed ring buffers)."""
    model = _model(on_device).eval()
    tokens = _tokens(model.config, batch=2).to(on_device.device)
    n = tokens.shape[1]
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2, n)
        parts = [model(tokens[:, :n - 48], cache)] + [model(tokens[:, i:i + 1], cache) for i in range(n - 48, n)]
    got = torch.cat(parts, 1)
    scale = float(full.abs().max())
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("how", ["autocast", "bfloat16-model"])
def test_bfloat16_trains_close_to_float32(on_device: DeviceUnderTest, how: str) -> None:
    """Under bf16 autocast (what ``precision = "bfloat16"`` does) and as a bf16 model: finite logits, the loss
    within 1% of float32's, the logits within bf16's precision of float32's but where a near tie routes otherwise,
    finite gradients for every parameter."""
    model = _model(on_device).train()
    tokens = _tokens(model.config, extra=1).to(on_device.device)
    with torch.no_grad():
        want = model(tokens[:, :-1]).double().cpu()
    if how == "autocast":
        with torch.autocast(on_device.device.type, dtype=torch.bfloat16):
            _step(model, model, tokens)
            logits = model(tokens[:, :-1])
    else:
        model = model.to(torch.bfloat16)
        _step(model, model, tokens)
        logits = model(tokens[:, :-1])
    assert logits.dtype == torch.bfloat16
    got = logits.detach().double().cpu()
    assert torch.isfinite(got).all(), f"bf16 ({how}): logits not finite"
    # A position whose routing scores tie within bf16's precision may take another cluster, and its logits move by
    # O(1); all the others stay within a few bf16 ulps.
    off = (got - want).abs() / want.abs().max()
    assert float(off.median()) < 1e-2 and float((off > 5e-2).double().mean()) < 1e-2, \
        f"bf16 ({how}): logits off by {float(off.median()):.2e} (median, of the largest), " \
        f"{float((off > 5e-2).double().mean()):.2%} of them by over 5%"
    loss = F.cross_entropy(got.flatten(0, 1), tokens[:, 1:].cpu().flatten())
    assert float(loss) == pytest.approx(float(F.cross_entropy(want.flatten(0, 1), tokens[:, 1:].cpu().flatten())),
                                        rel=1e-2)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"bf16 ({how}): gradient of {name}"


def _compiled(model: TransformerLM, dut: DeviceUnderTest):
    """What ``compile = true`` does to the model (``train.parallel.Parallelism.compiled``): torch.compile with
    inductor. On the CPU the aot_eager backend instead: the same graphs, guards and recompilations, and AOTAutograd's
    functionalisation (where an in-place op on a strided view fails, as the router's scatter_ did on CUDA),
    without inductor's code generation (minutes there)."""
    from routeformer.train.config import TrainConfig
    from routeformer.train.distributed import Processes
    from routeformer.train.parallel import Parallelism

    parallel = Parallelism(Processes(0, 1, 0, dut.device), TrainConfig(compile=True, device=str(dut.device)))
    return parallel.compiled(model) if dut.cuda else torch.compile(model, backend="aot_eager")


def test_compiled_training_matches_eager(on_device: DeviceUnderTest) -> None:
    """Two training steps of the compiled model: the same losses and gradients as eager mode."""
    eager = _model(on_device).train()
    twin = _model(on_device).train()
    compiled = _compiled(twin, on_device)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, twin)]
    for step in range(2):
        tokens = _tokens(eager.config, seed=10 + step, extra=1).to(on_device.device)
        losses = [float(_step(run, core, tokens)) for run, core in ((eager, eager), (compiled, twin))]
        assert losses[1] == pytest.approx(losses[0], rel=1e-4), f"step {step}: compiled {losses[1]}, eager {losses[0]}"
        _same_gradients(twin, eager, f"compiled, step {step}")
        for opt, core in zip(opts, (eager, twin), strict=True):
            opt.step()
            opt.zero_grad(set_to_none=True)
            core.after_optimizer_step()


def test_the_benchmark_baselines_compute_what_they_stand_beside(on_device: DeviceUnderTest) -> None:
    """``bench attention``'s CUDA baselines: SDPA held to its FlashAttention and cuDNN backends equal ``full``,
    FlexAttention's own sliding window equals ``local`` (bfloat16). Elsewhere they are not offered."""
    from routeformer.bench.attention import AttentionBench, candidates

    bench = AttentionBench(heads=2, head_dim=64, window=128, device=str(on_device.device), dtype=torch.bfloat16)
    found = {c.name: c for c in candidates(1024, bench)}
    pairs = {"sdpa-flash": "full", "sdpa-cudnn": "full", "flex-sliding (direct)": "local"}
    if not on_device.cuda:
        assert not set(pairs) & set(found)
        return
    q, k, v = (x.to(on_device.device, torch.bfloat16) for x in rand_qkv(1, 2, 1024, 64, torch.float32, grad=False))
    for name, beside in pairs.items():
        torch.testing.assert_close(found[name].attend(q, k, v).float(), found[beside].attend(q, k, v).float(),
                                   atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


# --- what a GPU step must not do -----------------------------------------------------------------------------------

def test_no_host_synchronisation_inside_a_training_step(on_device: DeviceUnderTest) -> None:
    """A training step's forward and backward (after one warm step) never wait for the GPU: a host read there
    stalls the launch queue every step. ``torch.cuda.set_sync_debug_mode("error")`` raises at the first."""
    if not on_device.cuda:
        pytest.skip("host synchronisation is a CUDA notion (ROUTEFORMER_TEST_DEVICE=cpu)")
    model = _model(on_device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = [_tokens(model.config, seed=s, extra=1).to(on_device.device) for s in range(2)]
    _step(model, model, tokens[0], opt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, model, tokens[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager-model", "compiled-model"])
def test_new_data_adds_no_compilation(on_device: DeviceUnderTest, compile_model: bool) -> None:
    """After two warm steps, three steps on new random tokens (centroids moving in between) compile nothing new:
    the compiled kernels' shapes must not follow the data, or every step recompiles until dynamo's recompile limit,
    after which FlexAttention runs eagerly (dense)."""
    model = _model(on_device).train()
    run = _compiled(model, on_device) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def compilations() -> dict[str, int]:
        return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"]}

    for step in range(5):
        if step == 2:
            before = compilations()
        _step(run, model, _tokens(model.config, seed=100 + step, extra=1).to(on_device.device), opt)
    assert compilations() == before, f"new data compiled again: {before} before the last three steps, " \
                                     f"{compilations()} after"
