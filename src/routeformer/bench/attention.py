"""Benchmark of every attention pattern against causal full attention, measured in the same run.

    routeformer bench attention [--n 1024 4096 16384] [--window 256] [--repeats 3] [--backend auto|tiles|flex]

Prints, per sequence length, forward and forward+backward time (median of consecutive runs), peak memory of an
inference forward and of a training forward+backward, and the forward+backward speed-up over ``full``; then, for
causal runs, the measured causal leak of every row (``leak.py``) at N = min(1024, largest N). Peer implementations
run beside ours when installed (``pip install -e ".[bench]"``); ``--only NAME`` keeps the peers of NAME (the
``peer_of`` of their row) as well as NAME. A row that cannot run (too much memory, an error) is printed with the
reason in a note column. ``--backend`` chooses the executor of our patterns (``auto``: FlexAttention on CUDA,
the fused kernels on the CPU); on CUDA a sliding window written directly with FlexAttention (``flex-sliding
(direct)``) runs beside ``local`` as the hand-written baseline, and full attention held to SDPA's FlashAttention
and cuDNN backends (``sdpa-flash``, ``sdpa-cudnn``) beside ``full``. ``--json FILE`` also writes the rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..attention import (
    FixedOptions,
    Inputs,
    KernelOptions,
    LinearOptions,
    LocalOptions,
    LongformerOptions,
    LSHOptions,
    RelativePositions,
    RoutingAttention,
    StridedOptions,
    fixed_attention,
    full_attention,
    linear_attention,
    local_attention,
    longformer_attention,
    lsh_attention,
    orthogonal_features,
    performer_attention,
    strided_attention,
)
from ..attention.blocks import default_block
from ..attention.kernels import feature_dim
from ..attention.linear import default_chunk
from ..attention.lsh import default_lsh_settings, lsh_hash, lsh_rotations
from ..attention.moba import MobaHeads, MobaOptions, moba_cross_attention
from ..attention.nsa import NsaHeads, NsaOptions
from ..attention.performer import default_features
from ..attention.routing import RoutingOptions, cross_routes, routing_cross_attention
from ..documents import documents_from_lengths
from ..executors import describe_backend, get_executor
from ..executors.fused.scan import scan_chunk
from ..lengths import sqrt_len
from . import roofline as rf
from .leak import causal_leak, leak_positions, verdict
from .measure import (
    PeakMemory,
    alternated_median_times,
    cpu_pages,
    format_table,
    kept_for_backward,
    measured_backend,
    median_time,
    memory_trackable,
    notes,
)

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class Candidate:
    name: str
    settings: str
    attend: Attend
    peer_of: str | None = None  # the row of ours a peer is compared with: ``--only`` that name keeps the peer
    skip: str | None = None  # why it is not run at this length (printed in the note column)
    training_bytes: Callable[[Tensor], int] | None = None  # estimate for q: training is not run if over half free
    useful: rf.Useful | None = None  # q -> the forward's useful FLOPs (``roofline.py``); None: not counted
    memory: bool = False  # cross-attention: k, v are a memory read whole (no causal order to leak across)


# Not run beyond this length: full-elu / full-poly2 (unfused O(N²) kernel attention) and linear-poly2 (F = 2145
# features at D = 64: 13 s forward+backward and 2.4 GiB at N = 4096 on 2 CPU threads, 0.11× full, ~4× both at 16k).
KERNEL_ATTENTION_MAX_N = 4096
UNTRACKED = "memory not tracked: on CPU FlexAttention's operator refuses the tracker's dispatch mode"
MEMORY_READ_WHOLE = ("a memory read whole, no causal order across the two sequences (tests/test_cross.py: each "
                     "query's output independent of the others)")
TRAINING_CAP_BYTES = 8 * 2**30  # over this (or half the free memory) estimated, a row is timed forward only


@dataclass(frozen=True)
class AttentionBench:
    """What ``bench attention`` measures: ``heads`` heads of ``head_dim`` on ``batch`` sequences, the local
    mechanisms' ``window``, in ``dtype`` on ``device``, causal or not, the patterns on ``backend``'s executor;
    ``only``: the mechanisms named (and the baseline; None: all); time the median of ``repeats``; the leak table
    at N = ``leak_n`` (None: min(1024, the longest N); 0: none); ``documents`` > 0: each of our rows measured again
    over rows packed with that many equal documents (``Inputs.of(..., documents=)``), the two timed call by call in
    turn (``measure.alternated_median_times``)."""

    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    window: int = 256
    repeats: int = 3
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    causal: bool = True
    only: tuple[str, ...] | None = None
    leak_n: int | None = None
    backend: str = "auto"
    documents: int = 0  # > 0: every one of our rows again over rows packed with this many equal documents


class PaperSizes(NamedTuple):
    """The settings the papers suggest at one length, for the rows of ours and the peers'."""

    clusters: int  # routing's k, round(√N)
    routed: int  # routing's keys per query, N / k
    buckets: int  # LSH's buckets per round
    lsh_window: int
    features: int  # Performer's m


def candidates(n: int, bench: AttentionBench = AttentionBench(), documents: Tensor | None = None) -> list[Candidate]:
    """The mechanisms compared at sequence length n, with the settings the papers suggest for it; the first is the
    baseline the others are measured against. ``bench.backend``: the executor of the patterns that run on one.
    ``documents`` (B, n): our mechanisms over packed documents (the peers and PyTorch's own rows are left out)."""
    heads, head_dim, window, causal, backend = bench.heads, bench.head_dim, bench.window, bench.causal, bench.backend
    device, dtype = torch.device(bench.device), bench.dtype
    stride = clusters = sqrt_len(n)
    routed = n // clusters  # window = N / k: clusters of the size the paper's balanced routing would give
    # the paper's rule: one cluster per query, no balancing bias
    paper = RoutingOptions(num_clusters=clusters, window=routed, probes=1, balance=0.0)
    routing = RoutingAttention(heads, head_dim, paper, causal=causal).to(device).train()
    routing.executor = get_executor(backend, device)
    # The multi-probe rule at the same keys per query: two clusters of half the window each (causal only).
    probed = max(1, routed // 2)
    probing = None
    if causal:
        options = RoutingOptions(num_clusters=clusters, window=probed, probes=min(2, clusters), balance=0.01)
        probing = RoutingAttention(heads, head_dim, options).to(device).train()
        probing.executor = get_executor(backend, device)
    # MoBA as MobaOptions makes it, at the block that gives routing's cost (top_k blocks of 2 √N / top_k); causal
    moba_options = MobaOptions()
    moba_block = default_block(n, moba_options.top_k)
    moba = None
    if causal:
        moba = MobaHeads(heads, head_dim, dataclasses.replace(moba_options, block=moba_block)).to(device)
        moba.executor = get_executor(backend, device)
    # NSA at MoBA's block and picks (its window branch a block long, its default)
    nsa_options = NsaOptions(block=moba_block, top=moba_options.top_k, window=moba_block)
    nsa = None
    if causal:
        nsa = NsaHeads(heads, head_dim, nsa_options).to(device)
        nsa.executor = get_executor(backend, device)
    rel = RelativePositions(head_dim, window).to(device=device, dtype=dtype)
    dilation = [1] * (heads - heads // 2) + [2] * (heads // 2)
    buckets, lsh_window = default_lsh_settings(n)
    rotations = lsh_rotations(heads, head_dim, buckets, 2).to(device)
    features = default_features(head_dim)
    projection = orthogonal_features(heads, features, head_dim, generator=torch.Generator().manual_seed(0),
                                     device=device)
    poly2 = feature_dim("poly2", head_dim)
    # the chunk the causal scan runs at: the executor's kernels' own where they take the call (scan_run), else the
    # PyTorch scan's
    kernels = get_executor(backend, device).runner(torch.empty(0, device=device, dtype=dtype)).scan_run is not None

    def scan_at(f: int) -> int:
        return scan_chunk(f) if kernels and causal else default_chunk(f)

    quadratic = (None if n <= KERNEL_ATTENTION_MAX_N else
                 f"not run at N > {KERNEL_ATTENTION_MAX_N}: exact O(N²) kernel attention, unfused")
    too_many_features = (None if n <= KERNEL_ATTENTION_MAX_N else
                         f"not run at N > {KERNEL_ATTENTION_MAX_N}: F={poly2} features, (B, H, N, F) feature maps")
    def pairs(count: Callable[[int], float]) -> rf.Useful | None:  # causal rows only: the counts are causal
        return (lambda q: rf.softmax_flops(count(q.shape[2]), q)) if causal else None

    def routed_work(module: RoutingAttention) -> rf.Useful | None:
        def useful(q: Tensor) -> float:
            with torch.no_grad():
                routes = module.routing.routes(q, q)
            B, H, N, D = q.shape
            seen = rf.pairs_in_groups(routes.keys, routes.probes, module.window, exclude_self=True)
            return rf.softmax_flops(seen, q) + 2.0 * D * module.num_clusters * B * H * N  # + the centroid scores
        return useful if causal else None

    def hashed_work(q: Tensor) -> float:
        hashes = lsh_hash(q.detach(), rotations)  # (B, H, rounds, N)
        B, H, R, N = hashes.shape
        seen = sum(rf.pairs_in_groups(hashes[:, :, r], hashes[:, :, r, :, None], lsh_window, exclude_self=True)
                   for r in range(R))  # a key two rounds share counts twice: an upper bound
        return rf.softmax_flops(seen, q) + 2.0 * q.shape[-1] * (buckets // 2) * R * B * H * N

    full_pairs, local_pairs = pairs(rf.pairs_full), pairs(lambda m: rf.pairs_local(m, window))
    # each mechanism's options made once, outside the timed calls
    local, strided, fixed = LocalOptions(window), StridedOptions(stride), FixedOptions(128, 8)
    longformer, lsh = LongformerOptions(window, dilation, (0,)), LSHOptions(buckets, 2, lsh_window)
    linear_poly2, full_elu, full_poly2 = LinearOptions("poly2"), KernelOptions("elu"), KernelOptions("poly2")
    found = [
        Candidate("full", "SDPA", lambda q, k, v: full_attention(Inputs.of(q, k, v, documents=documents), causal=causal),
                  useful=full_pairs),
        Candidate("local", f"window={window}",
                  lambda q, k, v: local_attention(Inputs.of(q, k, v, documents=documents), local, backend, causal=causal),
                  useful=local_pairs),
        Candidate("local+rel", f"window={window}, clip={window}",
                  lambda q, k, v: local_attention(Inputs.of(q, k, v, documents=documents), local, backend, causal=causal, rel=rel),
                  useful=local_pairs),
        Candidate("strided", f"stride={stride}, merged",
                  lambda q, k, v: strided_attention(Inputs.of(q, k, v, documents=documents), strided, backend, causal=causal),
                  useful=pairs(lambda m: rf.pairs_strided(m, stride, merged=True))),
        Candidate("strided-split", f"stride={stride}, split",
                  lambda q, k, v: strided_attention(Inputs.of(q, k, v, documents=documents), strided, backend, causal=causal,
                                                    merged=False),
                  useful=pairs(lambda m: rf.pairs_strided(m, stride, merged=False))),
        Candidate("fixed", "block=128, summary=8, merged",
                  lambda q, k, v: fixed_attention(Inputs.of(q, k, v, documents=documents), fixed, backend, causal=causal),
                  useful=pairs(lambda m: rf.pairs_fixed(m, 128, 8))),
        Candidate("longformer", f"window={window}, dilation 1|2, global [0]",
                  lambda q, k, v: longformer_attention(Inputs.of(q, k, v, documents=documents), longformer, backend, causal=causal),
                  useful=pairs(lambda m: rf.pairs_longformer(m, window, dilation, [0]))),
        Candidate("routing", f"k={clusters}, window={routed}, shared QK",
                  lambda q, k, v: routing(q, q, v, documents=documents), useful=routed_work(routing)),
        Candidate("routing-p2", f"k={clusters}, 2 probes × window={probed}, bias, shared QK",
                  lambda q, k, v: probing(q, q, v, documents=documents), skip=None if causal else "causal only",
                  useful=routed_work(probing) if probing is not None else None),
        Candidate("moba", f"block={moba_block}, top {moba_options.top_k} by the {moba_options.score} key",
                  lambda q, k, v: moba(q, k, v, None, documents=documents),
                  skip=None if causal else "causal only"),
        Candidate("nsa", f"block={moba_block}, top {nsa_options.top} by compressed keys, window {moba_block}, gates",
                  lambda q, k, v: nsa(q, k, v, None, documents=documents),
                  skip=None if causal else "causal only"),
        Candidate("lsh", f"buckets={buckets}, rounds=2, window={lsh_window}, shared QK, rotations fixed",
                  lambda q, k, v: lsh_attention(Inputs.of(q, q, v, documents=documents), lsh, backend, causal=causal, rotations=rotations),
                  useful=hashed_work if causal else None),
        Candidate("linear", f"elu, F={head_dim}, chunk={scan_at(head_dim)}",
                  lambda q, k, v: linear_attention(Inputs.of(q, k, v, documents=documents), None, backend, causal=causal),
                  useful=lambda q: rf.feature_flops(head_dim, q)),
        Candidate("linear-poly2", f"(1+s·q·k)², F={poly2}, chunk={default_chunk(poly2)}",
                  lambda q, k, v: linear_attention(Inputs.of(q, k, v, documents=documents), linear_poly2, causal=causal),
                  skip=too_many_features,
                  useful=lambda q: rf.feature_flops(poly2, q)),
        Candidate("performer", f"m={features}, orthogonal per head, drawn once, chunk={scan_at(features)}",
                  lambda q, k, v: performer_attention(Inputs.of(q, k, v, documents=documents), None, backend, causal=causal,
                                                      projection=projection),
                  useful=lambda q: rf.feature_flops(features, q, projection=True)),
        Candidate("full-elu", "exact elu kernel, O(N²) blocks",
                  lambda q, k, v: full_attention(Inputs.of(q, k, v, documents=documents), full_elu, causal=causal), skip=quadratic,
                  useful=full_pairs),
        Candidate("full-poly2", "exact (1+s·q·k)², O(N²) blocks",
                  lambda q, k, v: full_attention(Inputs.of(q, k, v, documents=documents), full_poly2, causal=causal), skip=quadratic,
                  useful=full_pairs),
    ]
    if documents is not None:  # ours only: the peers take no documents
        # (no useful-FLOP count: the pattern's counts are of one document a row)
        return [dataclasses.replace(c, name=f"{c.name}+docs", settings=f"{c.settings}; {bench.documents} documents",
                                    useful=None) for c in found]
    found[1:1] = _sdpa_backends(causal, device, full_pairs)
    found += _flex_sliding(window, causal, device)
    found += _cross_rows(n, bench, clusters, moba_block)
    found += _peers(n, bench, PaperSizes(clusters, routed, buckets, lsh_window, features))
    return found


def _cross_rows(n: int, bench: AttentionBench, clusters: int, block: int) -> list[Candidate]:
    """Cross-attention (issue 73): the N queries over a memory of N keys (the same tensors, read as two sequences),
    routed by the paper's sizes (k = √N centroids drawn once, one probe, windows of ceil(N / k) keys: routing's own
    keys per query) and by MoBA's blocks; the routing of queries and keys is in the time."""
    device = torch.device(bench.device)
    centroids = torch.randn(bench.heads, clusters, bench.head_dim, generator=torch.Generator().manual_seed(1),
                            dtype=bench.dtype).to(device)
    moba = MobaOptions(block=block)

    def routed(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return routing_cross_attention(Inputs.cross(q, k, v), cross_routes(q, k, centroids), None, bench.backend)

    return [
        Candidate("cross-routing", f"memory of N, k={clusters}, 1 probe, window={-(-n // clusters)}", routed,
                  memory=True),
        Candidate("cross-moba", f"memory of N, block={block}, top {moba.top_k} by the mean key",
                  lambda q, k, v: moba_cross_attention(Inputs.cross(q, k, v), moba, bench.backend), memory=True),
    ]


def _sdpa_backends(causal: bool, device: torch.device, useful: rf.Useful | None) -> list[Candidate]:
    """Full attention by PyTorch's SDPA held to one of its CUDA backends (``torch.nn.attention.sdpa_kernel``):
    FlashAttention and cuDNN's, the dense baselines a GPU user compares with (``full`` lets SDPA choose). Only on
    CUDA; both take float16 and bfloat16 only, and a dtype or GPU they refuse is the row's note."""
    if device.type != "cuda":
        return []
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def pinned(backend: SDPBackend) -> Attend:
        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            with sdpa_kernel(backend):  # the backward runs the kernel the forward chose
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return attend

    return [Candidate("sdpa-flash", "full, SDPA's FlashAttention backend", pinned(SDPBackend.FLASH_ATTENTION),
                      useful=useful),
            Candidate("sdpa-cudnn", "full, SDPA's cuDNN backend", pinned(SDPBackend.CUDNN_ATTENTION), useful=useful)]


def _flex_sliding(window: int, causal: bool, device: torch.device) -> list[Candidate]:
    """A sliding window written directly with FlexAttention (``create_block_mask`` of the window rule, compiled
    ``flex_attention``), as a user would: the baseline for ``local`` on CUDA. Not run elsewhere (uncompiled
    FlexAttention is dense)."""
    if device.type != "cuda":
        return []
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def rule(b, h, i, j):
        return ((j <= i) & (i - j < window)) if causal else ((i - j).abs() < window)

    masks: dict[tuple[int, int], object] = {}  # built once per shape, as FlexAttention's documentation advises

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        shape = (q.shape[2], k.shape[2])
        if shape not in masks:
            # _compile: built blockwise; uncompiled, create_block_mask evaluates all Nq · Nk pairs at once (42.9 GB
            # at 64k on the H200, 2026-11-27), which measured the mask's build and not the attention.
            masks[shape] = create_block_mask(rule, None, None, *shape, device=q.device, _compile=True)
        return compiled(q, k, v, block_mask=masks[shape])

    return [Candidate("flex-sliding (direct)", f"window={window}, block mask built once", attend, peer_of="local")]


def reformer_bucket_size(n: int, window: int) -> int | None:
    """reformer-pytorch's bucket_size closest to our lsh window from below: it needs n % (2 · bucket_size) == 0.
    None when n is odd (no bucket size fits)."""
    fits = [b for b in range(1, window + 1) if n % (2 * b) == 0]
    return max(fits) if fits else None


def _available_bytes(device: torch.device) -> int | None:
    """Memory free for one more allocation: CUDA's free memory, or the CPU's MemAvailable (Linux); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peers(n: int, bench: AttentionBench, sizes: PaperSizes) -> list[Candidate]:
    """lucidrains' ``local-attention``, ``routing-transformer``, ``reformer-pytorch`` and ``performer-pytorch``
    (PyPI), at our settings as far as their APIs allow, when installed; their attention cores on our (B, H, N, D)
    tensors (folded to (B·H, N, D) where they take 3-d inputs)."""
    window, causal, heads, head_dim = bench.window, bench.causal, bench.heads, bench.head_dim
    clusters, routed, lsh_window, device = sizes.clusters, sizes.routed, sizes.lsh_window, torch.device(bench.device)
    found = []
    try:
        from local_attention import LocalAttention
    except ImportError:
        pass
    else:
        # exact_windowsize: the same window as ours (i - window <= j <= i) rather than the whole previous block.
        local = LocalAttention(window_size=window, causal=causal, exact_windowsize=True, autopad=True)

        def attend_local(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            B, H, N, D = q.shape
            return local(q.reshape(B * H, N, D), k.reshape(B * H, N, D), v.reshape(B * H, N, D)).view(B, H, N, D)

        found.append(Candidate("local-attention (peer)", f"window={window}, exact", attend_local, peer_of="local"))
    try:
        from routing_transformer.routing_transformer import KmeansAttention
    except ImportError:
        pass
    else:
        # Its causal routing picks each cluster's members with later tokens (it leaks); timed as it is used.
        kmeans = KmeansAttention(clusters, routed, heads, head_dim, causal=causal, shared_qk=True).to(device).train()
        found.append(Candidate("routing-transformer (peer)", f"k={clusters}, window={routed}, shared QK",
                               lambda q, k, v: kmeans(q, q, v)[0], peer_of="routing"))
    found += _reformer_peer(n, causal, lsh_window)
    found += _performer_peer(n, causal, heads, head_dim, sizes.features, device)
    return found


def _reformer_peer(n: int, causal: bool, lsh_window: int) -> list[Candidate]:
    """reformer-pytorch's ``LSHAttention`` (shared QK, keys normalised, as ours): 2 hash rounds, buckets of our lsh
    window. It sorts by (bucket, position) and cuts the sorted sequence into chunks of ``bucket_size``, each seeing
    itself and the chunk before (up to 2 · bucket_size keys per round); it draws its rotations in every call
    (``torch.randn``, per (batch · head) here), which is timed with it. ``allow_duplicate_attention=False``: a key
    found by both rounds is counted once (their -log(count) correction; ours leaves it to its first round)."""
    try:
        from reformer_pytorch.reformer_pytorch import LSHAttention
    except ImportError:
        return []
    size = reformer_bucket_size(n, lsh_window)
    name = "reformer-pytorch (peer)"
    if size is None:
        return [Candidate(name, "-", _unavailable, peer_of="lsh",
                          skip=f"N={n} is odd: needs N divisible by 2 · bucket_size")]
    lsh = LSHAttention(bucket_size=size, n_hashes=2, causal=causal, allow_duplicate_attention=False,
                       random_rotations_per_head=True).eval()

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, H, N, D = q.shape
        return lsh(q.reshape(B * H, N, D), v.reshape(B * H, N, D))[0].view(B, H, N, D)

    return [Candidate(name, f"bucket_size={size} ({n // size} buckets), n_hashes=2, chunk + one back, shared QK, "
                            "counted once, rotations drawn per call", attend, peer_of="lsh")]


def _performer_peer(n: int, causal: bool, heads: int, head_dim: int, features: int,
                    device: torch.device) -> list[Candidate]:
    """performer-pytorch's ``FastAttention`` (FAVOR+ softmax kernel) with nb_features = ours: one (m, D) projection
    for all heads, drawn once at construction. Without the CUDA kernel of ``fast_transformers`` its causal path is
    ``causal_linear_attention_noncuda``: 128 chunks, each holding an (N/128, m, D) prefix-sum tensor per head, which
    training keeps for the backward pass; training is not run when that is estimated over
    ``TRAINING_CAP_BYTES`` or half the free memory."""
    try:
        from performer_pytorch import performer_pytorch as pp
    except ImportError:
        return []
    with torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(io.StringIO()):  # it prints a warning
        torch.manual_seed(0)
        fast = pp.FastAttention(head_dim, nb_features=features, causal=causal).to(device)
    noncuda = causal and fast.causal_linear_fn is pp.causal_linear_attention_noncuda
    settings = f"nb_features={features}, one projection for all heads, drawn once"
    settings += ", causal by chunked prefix sums (no CUDA kernel)" if noncuda else ""

    def training_bytes(q: Tensor) -> int:
        # the (N/128, m, D) context of each chunk, batch element and head, kept for the backward pass: peak
        # measured (PeakMemory, CPU) at 1.14 × B·H·N·m·D elements at N = 1024 and 2048, H = 8, D = 64
        B, H, N, D = q.shape
        return int(1.15 * B * H * N * features * D * q.element_size())

    return [Candidate("performer-pytorch (peer)", settings, fast, peer_of="performer",
                      training_bytes=training_bytes if noncuda else None)]


def _unavailable(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    raise RuntimeError("not runnable at this length")


def run(ns: list[int], bench: AttentionBench = AttentionBench(), echo: Callable[[str], None] = print) -> list[dict]:
    """Measure every candidate at every length; print one table per length (and, causal, the leak table of ``leaks`` at
    N = ``bench.leak_n``, default min(1024, max(ns)); 0 skips it); return the rows. ``echo``'s notes
    (``measure.Echo``): where the line naming the executor ``bench.backend`` runs as goes, once the mechanisms are
    chosen (the command line: stderr)."""
    b, dev = bench, torch.device(bench.device)
    results: list[dict] = []
    first = selected(candidates(ns[0], b), b.only)  # --only checked
    say = notes(echo)
    if say is not None:
        say(describe_backend(b.backend, dev, b.dtype))
    matmul = rf.matmul_gflops(dev, b.dtype)
    echo(f"# attention benchmark: B={b.batch}, H={b.heads}, D={b.head_dim}, {b.dtype}, {dev}, "
         f"{'causal' if b.causal else 'non-causal'}, backend {measured_backend(b.backend, dev)}, "
         f"threads={torch.get_num_threads()}{cpu_pages(dev)}, median of {b.repeats}; "
         f"dense matmul (2048³) {matmul:.0f} GFLOP/s")
    for i, n in enumerate(ns):
        cands = first if i == 0 else selected(candidates(n, b), b.only)
        if b.documents:
            cands = with_documents(cands, n, b)
        gen = torch.Generator(device="cpu").manual_seed(n)
        q, k, v, grad = (torch.randn(b.batch, b.heads, n, b.head_dim, generator=gen).to(dev, b.dtype)
                         for _ in range(4))
        track = memory_trackable(dev, b.backend)
        results += [{"n": n, **row} for row in _measure(cands, (q, k, v, grad), b.repeats, dev, track, say)]
        echo("")
        echo(attention_table([r for r in results if r["n"] == n]))
        echo("")
        echo(rf.roofline_table([r for r in results if r["n"] == n], matmul))
        if b.documents:
            echo("")
            echo(documents_table([r for r in results if r["n"] == n], b.documents))
    if len(ns) > 1:
        echo("")
        echo(memory_growth(results))
    leak_n = min(1024, max(ns)) if b.leak_n is None else b.leak_n
    if b.causal and leak_n:
        echo("")
        echo(leak_table(leaks(leak_n, b)))
    return results


def with_documents(cands: list[Candidate], n: int, bench: AttentionBench) -> list[Candidate]:
    """``cands`` with each of ours followed by its twin over rows of ``bench.documents`` equal documents (the
    last one takes the remainder), so that the two are timed together, call by call in turn (``_measure``)."""
    count = bench.documents
    if count > n:
        raise ValueError(f"--documents ({count}) is more than N ({n}): every document needs a position")
    lengths = [n // count] * (count - 1) + [n - n // count * (count - 1)]
    ids = documents_from_lengths([lengths] * bench.batch).to(bench.device)
    twins = {c.name.removesuffix("+docs"): c for c in candidates(n, bench, ids)}
    out = []
    for c in cands:
        out.append(c)
        if c.name in twins:
            out.append(dataclasses.replace(twins[c.name], skip=c.skip))
    return out


def documents_table(rows: list[dict], count: int) -> str:
    """Each of our rows over packed documents against itself without (timed call by call in turn)."""
    plain = {r["mechanism"]: r for r in rows if not r["mechanism"].endswith("+docs")}

    def ratio(a: float | None, b: float | None) -> str:
        return "n/a" if a is None or b is None else f"{a / b:.2f}"

    table = []
    for r in rows:
        if not r["mechanism"].endswith("+docs"):
            continue
        base = plain[r["mechanism"].removesuffix("+docs")]
        table.append([r["n"], base["mechanism"], _ms(base["fwd_s"]), _ms(r["fwd_s"]), ratio(r["fwd_s"], base["fwd_s"]),
                      _ms(base["fwd_bwd_s"]), _ms(r["fwd_bwd_s"]), ratio(r["fwd_bwd_s"], base["fwd_bwd_s"])])
    head = f"packed documents: {count} equal documents a row against one (each pair timed call by call in turn):"
    return head + "\n" + format_table(["N", "mechanism", "fwd ms", "with documents", "ratio", "fwd+bwd ms",
                                       "with documents", "ratio"], table)


def selected(every: list[Candidate], only: list[str] | None) -> list[Candidate]:
    """The baseline (first) and the candidates named in ``only`` (by the first word of their name) or whose
    ``peer_of`` is named there; all when ``only`` is None. A name that is none of them is a ValueError listing
    the choices."""
    if only is not None:
        names = {c.name.split(" ")[0] for c in every} | {c.peer_of for c in every if c.peer_of}
        unknown = [name for name in only if name not in names]
        if unknown:
            raise ValueError(f"--only: unknown mechanism(s) {', '.join(map(repr, unknown))}; choices: "
                             f"{', '.join(c.name.split(' ')[0] for c in every if not c.peer_of)}")
    return every[:1] + [c for c in every[1:]
                        if only is None or c.name.split(" ")[0] in only or c.peer_of in only]


def leaks(n: int, bench: AttentionBench = AttentionBench(), seed: int = 0) -> list[dict]:
    """The causal leak (``leak.causal_leak``, float32, batch 1) of every causal candidate built for length n,
    including the peers: one row per candidate with its settings, the largest change and the verdict
    (``bench``'s heads, head_dim, window, device, only and backend; its dtype, batch and causal aside)."""
    b = dataclasses.replace(bench, dtype=torch.float32, causal=True)
    dev = torch.device(b.device)
    rows = []
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, b.heads, n, b.head_dim, generator=gen).to(dev) for _ in range(3))
    for c in selected(candidates(n, b), b.only):
        if c.skip or c.memory:
            note = c.skip or MEMORY_READ_WHOLE
            rows.append({"mechanism": c.name, "settings": c.settings, "leak": None, "note": note})
            continue
        try:
            value = causal_leak(c.attend, q, k, v, seed=seed)
        except Exception as e:  # a peer that refuses this length: report it, measure the rest
            rows.append({"mechanism": c.name, "settings": c.settings, "leak": None, "note": _failure(e)})
        else:
            rows.append({"mechanism": c.name, "settings": c.settings, "leak": value, "note": verdict(value)})
    return [{"n": n, **r} for r in rows]


def leak_table(rows: list[dict]) -> str:
    """Markdown table of ``leaks`` rows."""
    n = rows[0]["n"] if rows else 0
    positions = ", ".join(map(str, leak_positions(n)))
    head = (f"causal leak at N={n}: max |Δ out[..., :t+1, :]| when q, k, v after t are redrawn, "
            f"t in {{{positions}}}:")
    table = format_table(["mechanism", "settings", "max |Δ out[:t+1]|", "leak"],
                         [[r["mechanism"], r["settings"], "n/a" if r["leak"] is None else f"{r['leak']:.2e}",
                           r["note"]] for r in rows])
    return head + "\n" + table


def _failure(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"failed: {type(e).__name__}: {text[:120]}"


def memory_growth(rows: list[dict]) -> str:
    """The exponent b of peak training memory ~ N^b, least-squares over the measured lengths, per mechanism."""
    lines = ["training peak memory ~ N^b, fitted over the lengths above:"]
    for name in dict.fromkeys(r["mechanism"] for r in rows):
        pts = [(math.log(r["n"]), math.log(r["training_bytes"])) for r in rows
               if r["mechanism"] == name and r["training_bytes"]]
        if len({x for x, _ in pts}) < 2:
            continue
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        lines.append(f"  {name:<28} b = {slope:.2f}")
    return "\n".join(lines)


def _measure(cands: list[Candidate], inputs: tuple[Tensor, Tensor, Tensor, Tensor], repeats: int,
             dev: torch.device, track_memory: bool = True, say: Callable[[str], None] | None = None) -> list[dict]:
    """Time (median of consecutive runs) and peak memory of each candidate on one input, q, k, v and the output's
    gradient (B, H, N, D) (``track_memory=False``:
    no memory columns, with a note). ``say``: a line per row once it is measured, with its seconds (compilation
    included: on CUDA a row's first call compiles its kernels), so that a run cut short shows how far it got."""
    q, k, v, grad = inputs
    for t in (q, k, v):
        t.requires_grad_(True)

    def forward(c: Candidate) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return c.attend(q, k, v)
        return call

    def train_step(c: Candidate) -> Callable[[], object]:
        def call() -> None:
            c.attend(q, k, v).backward(grad)
            q.grad = k.grad = v.grad = None
        return call

    def trains(c: Candidate, row: dict) -> bool:
        need = c.training_bytes(q) if c.training_bytes else 0
        free = _available_bytes(dev) if c.training_bytes else None
        limit = min(TRAINING_CAP_BYTES, free // 2 if free is not None else TRAINING_CAP_BYTES)
        if need > limit:
            row["note"] = (f"training not run: ~{need / 2**30:.1f} GiB estimated, over "
                           f"{limit / 2**30:.1f} GiB (min of 8 GiB and half the free memory)")
        return need <= limit

    def time_twins(pair: list[tuple[Candidate, dict]]) -> None:
        """A mechanism and its twin over packed documents timed call by call in turn (``alternated_median_times``);
        nothing recorded where either does not train or fails: each is then timed apart (``measure``)."""
        if not all([trains(c, row) for c, row in pair]):
            return
        try:
            fwd = alternated_median_times([forward(c) for c, _ in pair], repeats, dev)
            step = alternated_median_times([train_step(c) for c, _ in pair], repeats, dev)
        except Exception:
            q.grad = k.grad = v.grad = None
            return
        for (_, row), f, t in zip(pair, fwd, step, strict=True):
            row["fwd_s"], row["fwd_bwd_s"] = f, t

    def measure(c: Candidate, row: dict) -> None:
        if c.skip:
            return
        try:
            train = trains(c, row)
            if row["fwd_s"] is None:  # not timed with its twin
                row["fwd_s"] = median_time(forward(c), repeats, dev)
                if train:
                    row["fwd_bwd_s"] = median_time(train_step(c), repeats, dev)
            if not track_memory:
                row["note"] = row["note"] or UNTRACKED
                return
            with PeakMemory(dev) as inference:
                forward(c)()
            row["inference_bytes"] = inference.bytes
            if train:
                with PeakMemory(dev) as training:
                    train_step(c)()
                row["training_bytes"] = training.bytes
                row["kept_bytes"] = kept_for_backward(lambda c=c: c.attend(q, k, v))
        except Exception as e:  # out of memory, or a peer refusing the shape: report it, measure the rest
            q.grad = k.grad = v.grad = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            row["note"] = _failure(e)

    rows = [{"mechanism": c.name, "baseline": i == 0, "settings": c.settings, "fwd_s": None, "fwd_bwd_s": None,
             "inference_bytes": None, "training_bytes": None, "kept_bytes": None, "note": c.skip or "",
             "useful_flops": c.useful(q.detach()) if c.useful is not None and not c.skip else None}
            for i, c in enumerate(cands)]
    for i, (c, row) in enumerate(zip(cands, rows, strict=True)):
        started = time.perf_counter()
        twin = i + 1 < len(cands) and cands[i + 1].name == f"{c.name}+docs" and not c.skip
        if twin:  # timed together, call by call in turn: a pair's ratio is not the process's drift between them
            time_twins([(c, row), (cands[i + 1], rows[i + 1])])
        measure(c, row)
        if say is not None and not c.skip:  # flushed: scripts/device_check.py reads a cut run's rows from these
            say(f"measured {c.name} at N={q.shape[2]}: fwd {_ms(row['fwd_s'])}, fwd+bwd {_ms(row['fwd_bwd_s'])} ms,"
                f" inference {_mib(row['inference_bytes'])} MiB, training {_mib(row['training_bytes'])} MiB"
                f" ({time.perf_counter() - started:.0f} s{', ' + row['note'] if row['note'] else ''})")
    return rows


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def _mib(size: int | None) -> str:
    return "n/a" if size is None else f"{size / 2**20:.1f}"


def attention_table(rows: list[dict]) -> str:
    base = {r["n"]: r["fwd_bwd_s"] for r in rows if r["baseline"]}
    first = next((r["mechanism"] for r in rows if r["baseline"]), "first")

    def mib(b: int | None) -> str:
        return "n/a" if b is None else f"{b / 2**20:.0f}"

    def ms(t: float | None) -> str:
        return "n/a" if t is None else f"{t * 1e3:.1f}"

    def speedup(r: dict) -> str:
        b = base.get(r["n"])
        return "n/a" if b is None or r["fwd_bwd_s"] is None else f"{b / r['fwd_bwd_s']:.2f}×"

    notes = any(r.get("note") for r in rows)
    return format_table(
        ["N", "mechanism", "settings", "fwd ms", "fwd+bwd ms", "inference peak MiB", "training peak MiB",
         "kept for backward MiB", f"fwd+bwd speed-up vs {first}", *(["note"] if notes else [])],
        [[r["n"], r["mechanism"], r["settings"], ms(r["fwd_s"]), ms(r["fwd_bwd_s"]), mib(r["inference_bytes"]),
          mib(r["training_bytes"]), mib(r.get("kept_bytes")), speedup(r), *([r.get("note") or ""] if notes else [])]
         for r in rows],
    )
