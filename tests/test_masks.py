"""The mask builders against the papers' set definitions, enumerated one (i, j) at a time."""

from __future__ import annotations

import pytest
import torch

from routeformer.attention import fixed_mask, full_mask, local_mask, longformer_mask, strided_mask


def from_sets(n: int, allowed) -> torch.Tensor:
    return torch.tensor([[bool(allowed(i, j)) for j in range(n)] for i in range(n)])


@pytest.mark.parametrize("n", [1, 9, 23])
@pytest.mark.parametrize("causal", [True, False])
def test_full_and_local(n: int, causal: bool) -> None:
    assert torch.equal(full_mask(n, causal), from_sets(n, lambda i, j: j <= i or not causal))
    for w in [1, 3, 8, 40]:
        want = from_sets(n, (lambda i, j, w=w: i - w < j <= i) if causal else (lambda i, j, w=w: abs(i - j) < w))
        assert torch.equal(local_mask(n, w, causal), want)


@pytest.mark.parametrize("n, l", [(1, 1), (20, 4), (23, 5), (9, 12)])
@pytest.mark.parametrize("causal", [True, False])
def test_strided(n: int, l: int, causal: bool) -> None:
    if causal:
        a1 = lambda i, j: max(0, i - l) <= j <= i  # noqa: E731
        a2 = lambda i, j: j <= i and (i - j) % l == 0  # noqa: E731
    else:
        a1 = lambda i, j: abs(i - j) <= l  # noqa: E731
        a2 = lambda i, j: (i - j) % l == 0  # noqa: E731
    assert torch.equal(strided_mask(n, l, causal), from_sets(n, lambda i, j: a1(i, j) or a2(i, j)))
    split = strided_mask(n, l, causal, merged=False, heads=4)
    assert split.shape == (4, n, n)
    for h in range(4):
        assert torch.equal(split[h], from_sets(n, a1 if h < 2 else a2))


@pytest.mark.parametrize("n, l, c", [(1, 1, 1), (20, 4, 1), (23, 5, 2), (9, 12, 12)])
@pytest.mark.parametrize("causal", [True, False])
def test_fixed(n: int, l: int, c: int, causal: bool) -> None:
    a1 = lambda i, j: j // l == i // l and (j <= i or not causal)  # noqa: E731
    a2 = lambda i, j: j % l in range(l - c, l) and (j <= i or not causal)  # noqa: E731
    assert torch.equal(fixed_mask(n, l, c, causal), from_sets(n, lambda i, j: a1(i, j) or a2(i, j)))
    split = fixed_mask(n, l, c, causal, merged=False, heads=2)
    assert torch.equal(split[0], from_sets(n, a1)) and torch.equal(split[1], from_sets(n, a2))


@pytest.mark.parametrize("causal", [True, False])
def test_longformer(causal: bool) -> None:
    n, w, g = 25, 3, [2, 17]
    for dilations in ([1, 1], [2, 3]):
        mask = longformer_mask(n, w, dilations, g, causal)
        assert mask.shape == (2, n, n)
        for h, d in enumerate(dilations):
            def allowed(i, j, d=d):
                ms = range(-w + 1, 1) if causal else range(-w + 1, w)
                band = any(j == i + m * d for m in ms)
                glob = (i in g or j in g) and (j <= i or not causal)
                return band or glob
            assert torch.equal(mask[h], from_sets(n, allowed))
    assert longformer_mask(n, w, 2, g, causal).shape == (n, n)


@pytest.mark.parametrize("call, fragment", [
    (lambda: local_mask(5, 0), "window"),
    (lambda: local_mask(0, 2), "n must"),
    (lambda: strided_mask(5, -1), "stride"),
    (lambda: strided_mask(5, 2, merged=False), "heads"),
    (lambda: strided_mask(5, 2, merged=False, heads=3), "even"),
    (lambda: fixed_mask(5, 2, 3), "summary"),
    (lambda: fixed_mask(5, 2.0, 1), "block"),
    (lambda: longformer_mask(5, 2, global_tokens=[5]), "global_tokens"),
    (lambda: longformer_mask(5, 2, dilation=[1, 2], heads=3), "dilation"),
])
def test_bad_arguments(call, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        call()
