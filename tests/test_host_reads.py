"""No host synchronisation in a training step on the CUDA path: the flex executor's forward and backward of the
shipped configurations, and the optimiser step's routing update, read no tensor values on the host.

On CUDA every such read (``.item()``, ``int(t)``, ``bool(t)``, ``nonzero``, ``.tolist()``, ...) waits for the
device. On this CPU the flex executor runs the same code around FlexAttention's eager operator, so
``routeformer.testing.host_reads`` finds the reads a GPU run would wait on; the eager operator itself, which the
GPU compiles instead, runs unobserved (``FLEX_EAGER``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import rand_rel, routing_layer
from routeformer import TransformerConfig, TransformerLM
from routeformer.testing import FLEX_EAGER, host_reads

# Reads of tensors that live on the host by construction, so no device to wait for (and why).
ON_THE_HOST = {
    # the key blocks each query block's reach covers: arithmetic on torch.arange made on the CPU (flex/blocks.py)
    "executors/flex/blocks.py:_candidates",
}


def _device_reads(reads) -> list[str]:
    return [str(r) for r in reads.found if r.function not in ON_THE_HOST]


def test_the_detector_records_each_kind_of_read_with_its_caller() -> None:
    x = torch.arange(6.0, requires_grad=True)
    mask = x > 2

    def read_in_backward(g):
        int(g.sum())  # a read inside the backward pass
        return g

    with host_reads() as reads:
        int(x.max())
        bool(mask.any())
        x.tolist()
        x.detach().numpy()
        torch.nonzero(mask)
        x[mask]
        x.detach().unique()
        x.detach().repeat_interleave(torch.ones(6, dtype=torch.long))
        y = x * 2  # no read
        y.repeat_interleave(2)  # int repeats: the size is known
        y.register_hook(read_in_backward)
        y.sum().backward()
    what = [r.what for r in reads.found]
    assert what == ["aten._local_scalar_dense", "aten._local_scalar_dense", "Tensor.tolist", "Tensor.numpy",
                    "aten.nonzero", "aten.index with a bool index", "aten._unique2", "aten.repeat_interleave",
                    "aten._local_scalar_dense"], what
    assert all(r.stack[-1].filename == __file__ for r in reads.found), [r.stack[-1] for r in reads.found]
    assert "test_the_detector_records_each_kind_of_read_with_its_caller" in reads.report()


def test_unobserved_functions_run_without_the_detector() -> None:
    class Owner:
        @staticmethod
        def reads(t):
            return int(t.sum())

    with host_reads(((Owner, "reads"),)) as reads:
        Owner.reads(torch.ones(3))
    assert reads.found == []
    with host_reads() as reads:
        Owner.reads(torch.ones(3))
    assert [r.what for r in reads.found] == ["aten._local_scalar_dense"]
    assert "reads" in vars(Owner) and int(torch.ones(()).sum()) == 1  # restored


def _model(attention: str, options: dict, *, n: int, positions: str = "relative") -> TransformerLM:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=32, dim=32, depth=2, heads=2, seq_len=n, attention=attention,
                               options=options, backend="flex", positions=positions, rel_clip=8)
    return TransformerLM(config).train()


CONFIGS = {
    "local": ("local:2", {"local": {"window": 8}}, 64, "relative"),
    "routing, the paper's rule": ("local:1,routing:1", {"local": {"window": 8}, "routing": {
        "num_clusters": 4, "window": 8, "probes": 1, "balance": 0.0}}, 64, "relative"),
    "routing, two probes": ("routing:2", {"routing": {"num_clusters": 4, "window": 8, "probes": 2}}, 64,
                            "relative"),
    "routing, warm-up and hand-over": ("routing:2", {"routing": {
        "num_clusters": 4, "window": 8, "probes": 2, "warmup": 1, "handover": 1}}, 64, "relative"),
    "lsh": ("lsh:2", {"lsh": {"buckets": 4, "window": 8}}, 64, "absolute"),
    "moba, warm-up": ("moba:2", {"moba": {"block": 8, "top_k": 2, "warmup": 1}}, 64, "relative"),
    "moba, bound": ("moba:2", {"moba": {"block": 8, "top_k": 2, "score": "bound"}}, 300, "relative"),
    "nsa, warm-up": ("nsa:2", {"nsa": {"block": 8, "top": 2, "window": 8, "warmup": 1}}, 64, "relative"),
    # past probes.DENSE_UP_TO as well (the other executors' ranges read their tile sizes on the host; flex has its own)
    "routing, two probes at 300": ("routing:2", {"routing": {"num_clusters": 4, "window": 8, "probes": 2}}, 300,
                                   "relative"),
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_a_training_step_on_flex_reads_nothing_on_the_host(config) -> None:
    """Three steps (the warm-up's, the hand-over's and a routed one where there is a warm-up): forward, loss and
    backward read nothing; the optimiser step's routing update reads nothing once the centroids are seeded (the
    seeding itself, once, reads its samples)."""
    attention, options, n, positions = config
    model = _model(attention, options, n=n, positions=positions)
    tokens = torch.randint(0, 32, (2, n + 1), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        with host_reads(FLEX_EAGER) as reads:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss
            loss.backward()
        assert not _device_reads(reads), f"step {step}:\n{reads.report()}"
        with host_reads(FLEX_EAGER) as reads:
            model.after_optimizer_step(step)
        assert step == 0 or not reads.found, f"update {step}:\n{reads.report()}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled FlexAttention)")
@pytest.mark.parametrize("config", [c for c in CONFIGS.values() if not hasattr(c, "marks")],
                         ids=[name for name, c in CONFIGS.items() if not hasattr(c, "marks")])
def test_a_training_step_on_cuda_never_synchronises(config) -> None:
    """On the device itself: CUDA's sync debug mode turns every synchronising call (a read, a blocking copy)
    into an error. Each step runs its forward and backward once unchecked first (a new phase compiles, and
    compiling may synchronise), then again, and the routing update, checked; the first update (the seeding) is not
    checked."""
    attention, options, n, positions = config
    model = _model(attention, options, n=n, positions=positions).cuda()
    tokens = torch.randint(0, 32, (2, n + 1), generator=torch.Generator().manual_seed(0)).cuda()

    def forward_backward() -> None:
        logits = model(tokens[:, :-1])
        (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss).backward()

    for step in range(4):
        forward_backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            forward_backward()
            if step > 0:
                model.after_optimizer_step(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if step == 0:
            model.after_optimizer_step(step)


def test_balanced_routing_on_flex_reads_nothing_on_the_host() -> None:
    """The encoder's balanced clusters (a layer of its own: the model is causal), with relative positions and
    shared QK, forward and backward."""
    layer = routing_layer(2, 8, 4, 16, causal=False, backend="flex")
    g = torch.Generator().manual_seed(0)
    q, v = (torch.randn(2, 2, 64, 8, generator=g, requires_grad=True) for _ in range(2))
    rel = rand_rel(8, 4, dtype=torch.float32)
    for step in range(2):
        with host_reads(FLEX_EAGER) as reads:
            layer(q, q, v, rel_pos=rel).square().sum().backward()
        assert not _device_reads(reads), f"step {step}:\n{reads.report()}"
        layer.update()


def test_the_rows_of_later_parts_are_picked_without_a_host_read() -> None:
    """``ranges._pick`` (the merge's rows out of the tiles and the gathered pass's leftovers)."""
    from routeformer.executors.ranges import _pick

    g = torch.Generator().manual_seed(0)
    outs = (torch.randn(2, 3, 10, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g))
    index = torch.randint(0, 14, (2, 3, 7), generator=g)
    with host_reads() as reads:
        rows = _pick(outs, [0, 10, 14], index, None)
    assert reads.found == []
    laid = torch.cat(outs, 2)
    assert torch.equal(rows, laid.gather(2, index[..., None].expand(-1, -1, -1, 4)))
