"""Natively sparse: at N = 16384 the fast forwards peak far below one float32 N×N score matrix (4·N² bytes)."""

from __future__ import annotations

import pytest
import torch

from helpers import rand_qkv, rand_rel, routing_layer
from routeformer.attention import (
    FixedOptions,
    Inputs,
    LocalOptions,
    LongformerOptions,
    StridedOptions,
    fixed_attention,
    full_attention,
    local_attention,
    longformer_attention,
    strided_attention,
)
from routeformer.bench.measure import PeakMemory

N = 16384
SCORE_MATRIX = 4 * N * N  # bytes of one float32 (N, N) score matrix: 1 GiB


def _peak_forward(attend) -> int:
    q, k, v = rand_qkv(1, 1, N, 64, dtype=torch.float32)  # requires grad: saved activations count too
    with PeakMemory("cpu") as peak:
        out = attend(q, k, v)
        del out
    assert peak.bytes is not None
    return peak.bytes


@pytest.mark.parametrize("name, attend", [
    ("local", lambda q, k, v: local_attention(Inputs.of(q, k, v), LocalOptions(256))),
    ("local+relative", lambda q, k, v: local_attention(Inputs.of(q, k, v), LocalOptions(256),
                                                       rel=rand_rel(64, 256, dtype=torch.float32))),
    ("strided", lambda q, k, v: strided_attention(Inputs.of(q, k, v), StridedOptions(stride=128))),
    ("strided split", lambda q, k, v: strided_attention(Inputs.of(*(x.expand(1, 2, N, 64) for x in (q, k, v))),
                                                        StridedOptions(stride=128), merged=False)),
    ("fixed", lambda q, k, v: fixed_attention(Inputs.of(q, k, v), FixedOptions(block=128, summary=8))),
    ("longformer", lambda q, k, v: longformer_attention(Inputs.of(q, k, v), LongformerOptions(256, 2, [0, 5000]),
                                                        causal=True)),
    ("routing causal", lambda q, k, v: routing_layer(heads=1, head_dim=64, num_clusters=128, window=128)(q, q, v)),
    ("routing balanced", lambda q, k, v: routing_layer(heads=1, head_dim=64, num_clusters=128, window=128,
                                                          causal=False, balanced=True)(q, q, v)),
])
def test_sparse_forward_peaks_well_below_a_score_matrix(name: str, attend) -> None:
    peak = _peak_forward(attend)
    assert peak < SCORE_MATRIX / 4, f"{name} peaked at {peak / 2**20:.0f} MiB"


def test_the_meter_sees_a_score_matrix() -> None:
    """Control: on the tiles executor, relative positions in full attention build (N, N) scores, and the meter must
    see them; the fused executor computes the same in blocks and stays far below."""
    n = 2048
    q, k, v = rand_qkv(1, 1, n, 16, dtype=torch.float32)
    peaks = {}
    for backend in ("tiles", "fused"):
        with PeakMemory("cpu") as peak:
            full_attention(Inputs.of(q, k, v), None, backend, rel=rand_rel(16, 8, dtype=torch.float32))
        peaks[backend] = peak.bytes
    assert peaks["tiles"] >= 4 * n * n
    assert peaks["fused"] < 4 * n * n / 8
