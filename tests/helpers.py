"""Shared test machinery: random problems, the comparison with the dense reference, the leak check, the tiny
text data set and model that the command-line tests train, the banner line the commands begin with, and the device
the device tests run on (``device_under_test``)."""

from __future__ import annotations

import collections
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from routeformer.attention import KINDS, Inputs, RelativePositions, reference_attention
from routeformer.executors import resolve_backend

SANITIZE = "ROUTEFORMER_TEST_SANITIZE"  # "1": the fused kernels' sanitizer build (conftest.py, test_sanitizer.py)
# -D_GLIBCXX_ASSERTIONS: std::vector's [] checked; ROUTEFORMER_SANITIZE: products as plain loops and scratch of exactly
# the size asked for (csrc/common.h), so that the sanitizers see every access (none hides inside BLAS or a rounded-up
# allocation)
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1", "-D_GLIBCXX_ASSERTIONS",
                  "-DROUTEFORMER_SANITIZE")


def sanitized(build):
    """``build`` (a ``KernelBuild``) compiled with AddressSanitizer and UBSan, under a name of its own (its prefix
    and ``_asan``). Loading it needs the sanitizers' runtimes preloaded (``test_sanitizer.py``)."""
    from routeformer.executors.fused import KernelBuild

    return KernelBuild(f"{build.prefix}_asan", build.sources, build.headers, root=build.root,
                       extra_cflags=("-fopenmp", *SANITIZE_FLAGS), extra_ldflags=("-fopenmp", SANITIZE_FLAGS[0]),
                       what=f"{build.what} with AddressSanitizer and UBSan")


PATTERN_CASES = [  # every fixed pattern's shapes no test may miss: the partial first and last blocks, a grid, globals
    ("full", {}),
    ("local", {"window": 1}),
    ("local", {"window": 7}),
    ("local", {"window": 64}),
    ("strided", {"stride": 5, "merged": True}),
    ("strided", {"stride": 5, "merged": False}),
    ("fixed", {"block": 8, "summary": 3, "merged": True}),
    ("fixed", {"block": 8, "summary": 3, "merged": False}),
    ("longformer", {"window": 4, "dilation": 1}),
    ("longformer", {"window": 3, "dilation": [1, 2, 3, 4], "global_tokens": [0, 9, 30, 40]}),
]


def rand_qkv(B: int, H: int, N: int, D: int, dtype=torch.float64, seed: int = 0, grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(3)]


def rand_rel(D: int, k: int, seed: int = 0, dtype=torch.float64) -> RelativePositions:
    torch.manual_seed(seed)
    rel = RelativePositions(D, k, init_std=1.0)  # large tables so the relative terms matter in comparisons
    return rel.to(dtype)


def rand_padding(B: int, N: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(B, N, generator=g) > 0.3
    mask[0, : N // 2] = False  # some rows with no visible key at all
    return mask


def feature_inputs(seed: int = 0, shape: tuple[int, int, int, int] = (2, 3, 37, 8), features: int = 12,
                   dtype=torch.float64):
    """q, k, v (B, H, N, D) asking for gradients, a Performer projection (H, m, D) and key validity (B, 1, N) with
    about 30% padded keys: the feature scans' inputs."""
    from routeformer.attention.performer import orthogonal_features

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
    w = orthogonal_features(shape[1], features, shape[3], generator=gen).to(dtype)
    valid = torch.rand(shape[0], 1, shape[2], generator=gen) > 0.3
    return q, k, v, w, valid


def feature_map(name: str, projection: Tensor, scale: float):
    """Performer's features of ``projection`` at ``scale`` ("performer"), else elu's."""
    from routeformer.attention.linear import EluFeatures
    from routeformer.attention.performer import PerformerFeatures

    return PerformerFeatures(projection, scale) if name == "performer" else EluFeatures()


def fused_scan(q: Tensor, k: Tensor, v: Tensor, fmap, chunk: int | None, valid: Tensor | None) -> Tensor:
    """The fused executor's feature scan (its C++ operator) with the features of ``fmap`` (``feature_map``'s);
    an assertion where the kernels do not take the call."""
    from routeformer.attention.performer import PerformerFeatures
    from routeformer.executors.fused.scan import fused_feature_scan
    from routeformer.executors.tiling import FeatureKernel

    kernel = FeatureKernel(fmap.projection, fmap.scale) if isinstance(fmap, PerformerFeatures) else FeatureKernel()
    out = fused_feature_scan(q, k, v, kernel, chunk, valid)
    assert out is not None, "the kernels did not take the call"
    return out


def assert_close_with_grads(out: Tensor, ref: Tensor, inputs: tuple[Tensor, ...], *, rtol: float, atol: float,
                            grad_rtol: float, grad_atol: float) -> None:
    """``out`` equals ``ref`` within (rtol, atol), and so do the gradients both send to ``inputs`` from one random
    output gradient, within (grad_rtol, grad_atol)."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=grad_rtol, atol=grad_atol)


def compare_with_reference(attend, mask: Tensor, q, k, v, *, key_padding_mask=None, rel_pos=None,
                           rtol: float = 1e-10, atol: float = 1e-10) -> None:
    """Forward and gradients (q, k, v, relative tables) of ``attend`` equal the dense reference's."""
    out = attend(q, k, v, key_padding_mask=key_padding_mask, rel_pos=rel_pos)
    ref = reference_attention(Inputs.of(q, k, v, key_padding_mask=key_padding_mask), mask, rel=rel_pos)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    inputs = [q, k, v] + ([rel_pos.key, rel_pos.value] if rel_pos is not None else [])
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    want = torch.autograd.grad(ref, inputs, grad, allow_unused=True)
    for name, a, b in zip(["q", "k", "v", "a^K", "a^V"][: len(inputs)], got, want, strict=True):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert torch.isfinite(a).all(), f"non-finite gradient of {name}"
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, n=name: f"gradient of {n}: {m}")


def pattern_call(pattern, executor="auto", *, causal: bool = True, **params):
    """A pattern's fast function (``registry.Pattern.run``) under its mask builder's ``params``, called as
    ``attend(q, k, v, key_padding_mask=None, rel_pos=None)`` (``compare_with_reference``, ``leaks``)."""
    def attend(q, k, v, key_padding_mask=None, rel_pos=None):
        return pattern.run(Inputs.of(q, k, v, key_padding_mask=key_padding_mask), executor, causal=causal,
                           rel=rel_pos, **params)
    return attend


def future_changed(q, k, v, t: int, seed: int = 1):
    """Copies of q, k, v with every position > t replaced by different, larger random values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for x in (q, k, v):
        y = x.detach().clone()
        y[:, :, t + 1:] = 10 * torch.randn(y[:, :, t + 1:].shape, generator=g, dtype=y.dtype)
        out.append(y)
    return out


def leaks(attend, q, k, v, t: int, atol: float = 0.0) -> bool:
    """True when changing q, k, v after position t changes any output at positions <= t by more than ``atol``.

    The future is replaced by values ten times larger, so a real leak moves outputs by O(1). Fixed patterns are
    held to exact equality; routing sorts the sequence, and a changed future may move a query's (unchanged) keys
    to other tile columns, which changes the summation order by an ulp: it uses a tolerance far below O(1).
    """
    with torch.no_grad():
        before = attend(q.detach(), k.detach(), v.detach())
        after = attend(*future_changed(q, k, v, t))
    return not torch.allclose(before[:, :, : t + 1], after[:, :, : t + 1], rtol=0.0, atol=atol)


def sections_in_use(attention: str | list[str], sections: dict[str, dict]) -> dict[str, dict]:
    """The tables of ``sections`` ({section: {field: value}}) that the kinds named in ``attention`` read: a test's
    settings for every kind, given to a model of some of them. (A section of a kind not in use is checked and kept
    in ``TransformerConfig.options``: left out, the config is the one the test built when these settings were flat
    fields, which reached only the kinds in use.)"""
    specs = [attention] if isinstance(attention, str) else attention
    used = {KINDS[part.partition(":")[0].strip()].options_key for spec in specs for part in spec.split(",")}
    return {key: table for key, table in sections.items() if key in used}


def tiny_model_toml(depth: int) -> str:
    """The [model] table of the command-line tests: a byte model of dim 32, one local and one routing head. It ends
    with the [model.options.*] tables: what follows starts a table of its own."""
    return f"""
[model]
vocab_size = 256
dim = 32
depth = {depth}
heads = 2
seq_len = 32
attention = "local:1,routing:1"
rel_clip = 8

[model.options.local]
window = 8

[model.options.routing]
num_clusters = 3
window = 8
"""


def tiny_text_data(root: Path, text: str) -> Path:
    """Prepare ``text`` as the text data set 'tiny' under root/data (from the file root/corpus/a.py); returns
    root/data."""
    from routeformer.data import prepare

    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text(text)
    prepare("text", root / "data", str(corpus), dataset_name="tiny")
    return root / "data"


def routing_layer(heads: int, head_dim: int, num_clusters: int, window: int, causal: bool = True, *,
                  balanced: bool | None = None, seed: int = 0, backend=None, probes: int = 1, balance: float = 0.0,
                  **options):
    """A ``RoutingAttention`` from the layer's arguments, with the paper's rule unless told (probes 1, balance 0:
    ``RoutingOptions``' defaults are the model's, two probes and a bias) and the executor ``backend`` names."""
    from routeformer.attention.routing import RoutingAttention, RoutingOptions
    from routeformer.executors import get_executor

    layer = RoutingAttention(heads, head_dim, RoutingOptions(num_clusters=num_clusters, window=window, probes=probes,
                                                             balance=balance, **options),
                             causal=causal, balanced=balanced, seed=seed)
    if backend is not None:
        layer.executor = get_executor(backend)
    return layer


def make_router(heads: int, head_dim: int, num_clusters: int, *, seed: int = 0, probes: int = 1, balance: float = 0.0,
                **options):
    """A ``Router`` from its old arguments, with the paper's rule unless told (as ``routing_layer``)."""
    from routeformer.attention.routing import Router, RoutingOptions

    return Router(heads, head_dim, RoutingOptions(num_clusters=num_clusters, probes=probes, balance=balance, **options),
                  seed=seed)


def banner(err: str) -> str:
    """The first line a command printed on stderr, past what building the model says before it: the fused kernel's
    compilation line (first use only) and its warning when it is unavailable (file:line: category: message, then
    the source line, indented)."""
    lines = [line for line in err.splitlines() if line and not line.startswith(("routeformer: compiling", " "))
             and not re.match(r"\S+:\d+: \w+: ", line)]
    return lines[0] if lines else ""


def executor_named(device: str = "cpu") -> str:
    """The words the banner begins with for the model of these tests (local and routing heads) on ``device``."""
    chosen = resolve_backend("auto", device)
    return f"attention: {'fused C++ kernel' if chosen == 'fused' else chosen} ("


TEST_DEVICE = "ROUTEFORMER_TEST_DEVICE"  # where tests/test_cuda.py runs: cuda (the default), cuda:N or cpu


@dataclass(frozen=True)
class DeviceUnderTest:
    """Where the device tests (``tests/test_cuda.py``, marker ``cuda``) run, and how.

    device: the device; backend: the executor named in the models and layers ("auto" on CUDA, which resolves to
    "flex"; "flex" on the CPU, its dense eager path, so that the same tests run without a GPU and cannot rot);
    n: the sequence length of the layer tests, which spans many of the executor's blocks there (FlexAttention's
    blocks are 128 wide on CUDA) and, past 256, takes multi-probe routing off its one dense tile onto its ranges;
    model_n: the models' (on the CPU shorter: FlexAttention's eager operator is dense there, and its relative
    terms take a pass per offset)."""

    device: torch.device
    backend: str
    n: int
    model_n: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def device_under_test() -> DeviceUnderTest:
    """The device ``ROUTEFORMER_TEST_DEVICE`` names (default cuda); skips the test when it is CUDA and this PyTorch
    sees none, and refuses a value that names no usable device."""
    import pytest

    name = os.environ.get(TEST_DEVICE, "cuda")
    if name == "cpu":
        return DeviceUnderTest(torch.device("cpu"), "flex", 320, 128)
    if name != "cuda" and not re.fullmatch(r"cuda:\d+", name):
        raise ValueError(f"{TEST_DEVICE}={name!r}: expected cuda, cuda:N or cpu")
    if not torch.cuda.is_available():
        pytest.skip(f"needs CUDA ({TEST_DEVICE}={name}; this PyTorch sees no GPU): set {TEST_DEVICE}=cpu to run "
                    "these tests on the CPU")
    device = torch.device(name)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{TEST_DEVICE}={name!r}: there are {torch.cuda.device_count()} CUDA devices")
    return DeviceUnderTest(device, "auto", 2048, 2048)


def _listed(num: torch.Tensor, idx: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """(B, H, rows, n_blocks) bool: the first num[..., r] entries of idx's row r (a BlockMask's table, any width)."""
    first = torch.arange(idx.shape[-1]) < num[..., None]
    table = torch.zeros(*idx.shape[:-1], n_blocks, dtype=torch.long)
    return table.scatter_add_(-1, idx.long(), first.long()) > 0


def _rule_blocks(mask_mod, B: int, H: int, N: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(some, every) (B, H, nb, nb): the blocks with an allowed pair, and those whose every pair is allowed and in
    range (whole blocks), from ``mask_mod`` evaluated on every pair."""
    nb = -(-N // block)
    i = torch.arange(nb * block).view(1, 1, -1, 1)
    j = torch.arange(nb * block).view(1, 1, 1, -1)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    allowed = (mask_mod(b, h, i, j) & (i < N) & (j < N)).expand(B, H, -1, -1)
    grid = allowed.reshape(B, H, nb, block, nb, block)
    return grid.any(-1).any(-2), grid.all(-1).all(-2)


def check_interval_tables(mask_mod, mask, shape: tuple[int, int, int], block: int, exact: bool,
                          full: bool = True) -> None:
    """A square-block ``BlockMask`` of N queries and keys (``flex.blocks.interval_block_mask``) against its rule,
    kv-major and q-major: the full blocks exactly those whose every pair ``mask_mod`` allows (``full=False``: none
    listed full); the listed ones (partial or full) every block with an allowed pair, and no other where ``exact``;
    int32 tables, contiguous."""
    B, H, N = shape
    nb = -(-N // block)
    some, every = _rule_blocks(mask_mod, B, H, N, block)
    for num, idx, full_num, full_idx, transpose in (
            (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, False),
            (mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices, True)):
        assert idx.shape == full_idx.shape and idx.shape[:3] == (B, H, nb) and idx.is_contiguous()
        assert num.dtype == idx.dtype == torch.int32
        partial, full_blocks = _listed(num, idx, nb), _listed(full_num, full_idx, nb)
        if transpose:
            partial, full_blocks = partial.transpose(-1, -2), full_blocks.transpose(-1, -2)
        assert not (partial & full_blocks).any()
        assert torch.equal(full_blocks, every if full else torch.zeros_like(every))
        listed = partial | full_blocks
        assert not (some & ~listed).any(), "a block holding an allowed pair is missing"
        if exact:
            assert torch.equal(listed, some)


class OperatorCount(TorchDispatchMode):
    """A dispatch mode counting the operators dispatched, views aside (``ops``: name -> calls), and the largest
    tensor any of the counted ones returns (``largest``, elements; ``largest_float``, of the floating-point ones): on
    the ``meta`` device it counts a forward's kernel launches and their sizes without computing anything."""

    VIEWS = frozenset({"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "detach", "slice", "select", "t",
                       "transpose", "permute", "alias", "as_strided", "unfold", "lift_fresh", "split", "unbind"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.largest = 0
        self.largest_float = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.ops[name] += 1
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor):
                    self.largest = max(self.largest, x.numel())
                    if x.is_floating_point():
                        self.largest_float = max(self.largest_float, x.numel())
        return out


def period(row: Tensor, lengths: range) -> int | None:
    """The shortest L in ``lengths`` with row[j] == row[j - L] for every j >= L, if any: how a row of the curriculum
    of repeated text is recognised."""
    return next((n for n in lengths if torch.equal(row[n:], row[:-n])), None)


def write_mo(path: Path, messages: dict[str, str], charset: str = "UTF-8") -> Path:
    """A compiled catalog as msgfmt writes one (no hash table): the header entry, then ``messages`` sorted by
    msgid. A msgid may carry a context ("ctx\\x04msgid") or a plural ("one\\x00many" with "ein\\x00viele")."""
    entries = {"": f"Content-Type: text/plain; charset={charset}\nPlural-Forms: nplurals=2; plural=(n != 1);\n",
               **messages}
    keys = sorted(entries)
    ids = [k.encode(charset) for k in keys]
    strs = [entries[k].encode(charset) for k in keys]
    n = len(keys)
    originals, translations = 28, 28 + 8 * n
    data_at = 28 + 16 * n
    blob, table_o, table_t = b"", [], []
    for raw, table in [(x, table_o) for x in ids] + [(x, table_t) for x in strs]:
        table.append((len(raw), data_at + len(blob)))
        blob += raw + b"\0"
    header = struct.pack("<7I", 0x950412DE, 0, n, originals, translations, 0, 0)
    body = b"".join(struct.pack("<2I", *e) for e in table_o) + b"".join(struct.pack("<2I", *e) for e in table_t)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + body + blob)
    return path
