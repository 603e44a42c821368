"""The fused operators at their boundary: a call that breaks an operator's contract is an error that names the
operator and the argument, never a crash; a call that keeps it still gives finite results, the unmutated call's when
the change keeps its meaning. Mutated calls run in worker processes (``fused_boundary.py``: a crash kills only the
worker, and the test reports the mutation it was running). The Python entry points broadcast per-position values
given for one batch entry or head, and refuse what does not fit before the kernels."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fused_boundary as fb
from helpers import rand_qkv, rand_rel
from routeformer.attention import Inputs, LocalOptions, LSHOptions, local_attention, reference_attention
from routeformer.attention.lsh import lsh_attention
from routeformer.executors import get_executor
from routeformer.executors.fused.executor import fused_rounds
from routeformer.executors.inputs import RelTerms
from routeformer.executors.ranges import KeyOrder, Ranges
from routeformer.executors.tiling import Distances, HashRounds, KeyRestrictions, Tiling

FUSED, TILES = get_executor("fused"), get_executor("tiles")
OPS = torch.ops.routeformer_fused


@pytest.fixture(autouse=True, scope="module")
def _loaded() -> None:
    """The operators are registered when the kernels load: in a worker where no earlier test loaded them, ``OPS``
    would have no attributes yet."""
    from routeformer.executors.fused import available

    assert available(), "the fused kernels are not built"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The recorded calls, and the file the workers load them from."""
    calls = fb.record()
    path = tmp_path_factory.mktemp("fused_boundary") / "calls.pt"
    fb.save_calls(calls, path)
    return calls, path


def _report(calls, specs, result) -> list[str]:
    """One line per mutation whose outcome is wrong (or that crashed its worker)."""
    lines = []
    for n, outcome in sorted(result["outcomes"].items()):
        if not outcome["ok"]:
            call = calls[specs[n]["call"]]
            lines.append(f"{call.op} [{call.scenario}] {fb.names(call.op)[specs[n]['arg']]} {specs[n]}: {outcome}")
    if result["rc"] != 0 and not result["crashes"]:
        lines.append(f"the worker failed (rc {result['rc']}): {result['stderr']}")
    return lines


def test_the_recorded_calls_reach_every_operator_both_ways(recorded) -> None:
    calls, _ = recorded
    assert {c.op for c in calls} == set(fb.OPS)
    assert all(fb.violation(c.op, c.args) is None for c in calls), "a recorded call breaks the written contract"


# --- mutations drawn by hypothesis -------------------------------------------------------------------------------

_BOUNDARY = [0, -1, 1, 2, 3, 13, 14, fb.HUGE, fb.INT64_MIN, fb.INT64_MAX]
_ints = st.one_of(st.sampled_from(_BOUNDARY), st.integers(fb.INT64_MIN, fb.INT64_MAX), st.integers(-20, 20))


@st.composite
def _mutation(draw, calls) -> dict:
    """One argument of one recorded call, changed one way (``fused_boundary.apply``'s kinds)."""
    c = draw(st.integers(0, len(calls) - 1))
    call = calls[c]
    i = draw(st.integers(0, len(call.args) - 1))
    x, kind = call.args[i], fb._kind(call, i)
    if x is None:
        return dict(call=c, arg=i, kind="give")
    if kind == "bools":  # the backward's output_mask: one entry flipped, or a list of another length
        if draw(st.integers(0, 3)) == 0:
            return dict(call=c, arg=i, kind="length", by=draw(st.sampled_from([-1, 1])))
        return dict(call=c, arg=i, kind="flip", at=draw(st.integers(0, len(x) - 1)))
    if kind == "ints":
        if draw(st.integers(0, 9)) == 0:
            return dict(call=c, arg=i, kind="length", by=draw(st.sampled_from([-1, 1])))
        return dict(call=c, arg=i, kind="entry", at=draw(st.integers(0, len(x) - 1)), value=draw(_ints))
    if kind == "bool":
        return dict(call=c, arg=i, kind="toggle")
    if kind == "int":
        return dict(call=c, arg=i, kind="int", value=draw(_ints))
    if kind == "float":
        # not any float: a finite scale large enough to overflow the scores gives NaN on every executor
        value = draw(st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), st.floats(-10, 10)))
        return dict(call=c, arg=i, kind="scale", value=value)
    kinds = ["none", "dim", "rank", "dtype", "strided", "padded_rows"] + (["batch_of_one", "batch_broadcast"]
                                                                         if x.dim() and x.shape[0] > 1 else [])
    if kind == "index" and x.numel():
        kinds += ["value", "value", "value", "repeat"]
    k = draw(st.sampled_from(kinds))
    spec = dict(call=c, arg=i, kind=k)
    if k == "dim" and x.dim():
        spec.update(dim=draw(st.integers(0, x.dim() - 1)), to=draw(st.sampled_from(["+1", "-1", "1", "0"])))
    elif k == "dim":
        spec["kind"] = "none"
    elif k == "rank":
        spec["by"] = draw(st.sampled_from([-1, 1]))
    elif k == "dtype":
        spec["dtype"] = draw(st.sampled_from(["float32", "float64", "int64", "int32", "bool", "float16"]))
    elif k == "value":
        spec.update(at=draw(st.integers(0, x.numel() - 1)), value=draw(_ints))
    return spec


@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_mutated_calls_raise_or_stay_valid_and_never_crash(recorded, data) -> None:
    """Each example: a batch of one-argument mutations in one worker process. An outcome is right when the call
    raised exactly where the written contract (``fused_boundary.violation``) says it breaks, and otherwise returned
    finite results (equal to the unmutated call's where the change keeps its meaning)."""
    calls, path = recorded
    specs = data.draw(st.lists(_mutation(calls), min_size=100, max_size=100))
    result = fb.run_batch(path, specs, timeout=120)
    assert not result["crashes"], "\n".join(_report(calls, specs, result))
    assert result["rc"] == 0 and len(result["outcomes"]) == len(specs), result["stderr"]
    wrong = _report(calls, specs, result)
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_mutation_of_every_recorded_call(recorded) -> None:
    """The enumeration: every recorded call × every mutation of every argument (``fused_boundary.mutations``,
    about 8,000 calls)."""
    calls, path = recorded
    specs = fb.enumerate_all(calls)
    result = fb.run_batch(path, specs, timeout=1200)
    wrong = _report(calls, specs, result)
    assert not result["crashes"] and result["rc"] == 0 and not wrong, "\n".join(wrong[:40])


# --- the errors name the operator and the argument ---------------------------------------------------------------


def _band_call():
    """A valid band_forward call over an order: B = 2, H = 2, N = 13."""
    q, k, v = rand_qkv(2, 2, 13, 4, grad=False)
    order = torch.stack([torch.randperm(13) for _ in range(4)]).view(2, 2, 13)
    geometry = [4, 1, 0, 0, 0, 0, 0, 0, 4, 1, 0, 0, 0, 16, 0]  # a causal window of 4 (the kernel's offsets (-3, 0))
    return [q, k, v, geometry, 0.5, None, None, None, None, order, None, None, None, None, None]


_BAND_ERRORS = {  # argument: (its change, the error)
    "order": (lambda a: a[:1].contiguous(), r"order must be \(B, H, N\) = \(2, 2, 13\), got \(1, 2, 13\)"),
    "order entry": (lambda a: a.clone().index_fill_(-1, torch.tensor([0]), 13),
                    r"order must hold a permutation of 0 \.\. 12"),
    "order dtype": (lambda a: a.int(), r"order must be Long, got Int"),
    "k": (lambda a: a[:, :1], r"k must be \(B, H, N, D\) with q's B, H, D = \(2, 2, 13, 4\), got \(2, 1, 13, 4\)"),
    "v": (lambda a: a[..., :12, :], r"v must be \(B, H, N, D\) like k"),
    "geometry block": (lambda a: [0, *a[1:]], r"geometry\[0\] \(block\) must be >= 1, got 0"),
    "geometry rows_per_block": (lambda a: a[:13] + [0, 0], r"geometry\[13\] \(rows_per_block\) must be >= 1"),
    "geometry window": (lambda a: a[:5] + [1, -3, 0] + a[8:], r"geometry gives a window \(4\) and offsets \(-3, 0\): "
                        r"a window's offsets are its own"),
    "geometry causal": (lambda a: a[:8] + [0, 1] + a[10:], r"geometry's causal flag names a window's side: causal "
                        r"without a window"),
    "key_valid": (lambda a: torch.ones(1, 1, 13, dtype=torch.bool), r"key_valid must be \(B, 1 or H, N\)"),
    "bias": (lambda a: torch.zeros(3, 1, 1, 1, 1, dtype=torch.float64),
             r"bias must broadcast to \(B, H, n_tiles, T, S\) = \(2, 2, 4, 4, 8\)"),
    "key_table": (lambda a: torch.zeros(5, 4, dtype=torch.float64), r"key_table and value_table come together"),
}


@pytest.mark.parametrize("case", sorted(_BAND_ERRORS))
def test_band_forward_names_the_argument(case: str) -> None:
    change, message = _BAND_ERRORS[case]
    args = _band_call()
    i = fb.names("band_forward").index(case.split()[0])
    args[i] = change(args[i])
    with pytest.raises(RuntimeError, match="routeformer_fused.band_forward: " + message):
        OPS.band_forward(*args)


def test_a_geometry_names_its_fields() -> None:
    """A list of the wrong length names every field; a flag out of 0, 1 names its field."""
    args = _band_call()
    args[3] = args[3][:14]
    with pytest.raises(RuntimeError, match=r"band_forward: geometry must hold 15 integers \(block, back, ahead, rows, "
                                           r"single, .*, window, causal, .*, positions_from_order\), got 14"):
        OPS.band_forward(*args)
    args[3] = _band_call()[3]
    args[3][10] = 2
    with pytest.raises(RuntimeError, match=r"band_forward: geometry\[10\] \(exclude_self\) must be 0 or 1, got 2"):
        OPS.band_forward(*args)


def test_the_geometries_agree_across_the_boundary(monkeypatch) -> None:
    """Each dataclass of ``fused/geometry.py`` lists the C++ struct's fields in its order; a field moved on one side
    only is an error naming both lists when the library loads."""
    from routeformer.executors.fused import geometry

    for which, cls in geometry.GEOMETRIES.items():
        assert tuple(OPS.geometry_fields(which)) == cls.names()
    with pytest.raises(RuntimeError, match="geometry_fields: which must be band, ranges or rounds, got tiles"):
        OPS.geometry_fields("tiles")

    @dataclasses.dataclass(frozen=True)
    class Moved(geometry._Geometry):
        window: int
        causal: bool
        rows_per_block: int

    monkeypatch.setitem(geometry.GEOMETRIES, "rounds", Moved)
    with pytest.raises(RuntimeError, match=r"rounds geometry has the fields \['window', 'rows_per_block', "
                                           r"'causal'\] but fused/geometry.py's Moved has \['window', 'causal', "
                                           r"'rows_per_block'\]"):
        geometry.check_fields()


def test_ranges_and_rounds_and_gelu_name_the_argument() -> None:
    q, k, v = rand_qkv(1, 2, 8, 4, grad=False)
    lo = torch.zeros(1, 2, 8, dtype=torch.long)
    hi = torch.full((1, 2, 8), 9)
    with pytest.raises(RuntimeError, match=r"ranges_forward: lo and hi must have 0 <= lo <= hi <= N = 8, got lo 0, "
                                           r"hi 9"):
        OPS.ranges_forward(q, k, v, lo, hi, [1, 16, 8, 0], 0.5, None, None, None, None, None, None, None)
    with pytest.raises(RuntimeError, match=r"ranges_forward: k must be \(B, H, N, D\) with q's B, H, D"):
        OPS.ranges_forward(q, k[..., :3], v, lo, hi.clamp_max(8), [1, 16, 8, 0], 0.5, None, None, None, None, None,
                           None, None)
    order = torch.arange(8).expand(1, 2, 1, 8).contiguous()
    groups = torch.zeros(1, 2, 1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"rounds_forward: geometry\[0\] \(window\) must be >= 1, got 0"):
        OPS.rounds_forward(q, None, v, order, groups, groups, None, [0, 16, 1], 0.5)
    with pytest.raises(RuntimeError, match=r"rounds_forward: groups must be non-decreasing"):
        OPS.rounds_forward(q, None, v, order, order.flip(-1).contiguous(), groups, None, [2, 16, 1], 0.5)
    with pytest.raises(RuntimeError, match=r"rounds_forward: v must be \(B, H, N, D\) like q = \(1, 2, 8, 4\), got "
                                           r"\(1, 1, 8, 4\)"):
        OPS.rounds_forward(q, None, v[:, :1], order, groups, groups, None, [2, 16, 1], 0.5)
    with pytest.raises(RuntimeError, match=r"sigmoid_gelu_backward: grad must be x's shape"):
        OPS.sigmoid_gelu_backward(torch.ones(3), torch.ones(4))


# --- the Python entry points ------------------------------------------------------------------------------------


def test_an_order_and_groups_for_one_batch_entry_stand_for_every_entry() -> None:
    """An order, groups and positions of shape (1, H, N) with B = 2 (which the kernel once read past its end): the
    same for both batch entries, as on the tiles executor and in the dense definition."""
    B, H, N, D = 2, 2, 13, 4
    q, k, v = rand_qkv(B, H, N, D, grad=False)
    g = torch.Generator().manual_seed(3)
    order = torch.randperm(N, generator=g).expand(1, H, N)
    groups = torch.randint(0, 3, (1, H, N), generator=g).sort(-1).values
    rel = rand_rel(D, 3)
    tiling = Tiling(block=4, back=1, offsets=(-4, 0), order=order)
    kw = dict(restrict=KeyRestrictions(groups=groups, exclude_self=True), rel=RelTerms(rel, Distances(positions=order)))
    inputs = Inputs(q, k, v, 0.5)
    out, _ = FUSED.tiled(inputs, tiling, **kw)
    tiles, _ = TILES.tiled(inputs, tiling, **kw)
    full = order.expand(B, H, N)
    expanded, _ = FUSED.tiled(inputs, dataclasses.replace(tiling, order=full),
                              restrict=KeyRestrictions(groups=groups.expand(B, H, N), exclude_self=True),
                              rel=RelTerms(rel, Distances(positions=full)))
    torch.testing.assert_close(out, tiles, rtol=1e-10, atol=1e-10)
    assert torch.equal(out, expanded)
    # The definition, in the original order: sorted row i sees sorted keys i - 4 .. i of its group, its own only
    # when nothing else; a pair's distance is its original positions' difference, as in the dense reference.
    i = torch.arange(N)
    own = torch.eye(N, dtype=torch.bool)
    allow = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 4) & (groups[0][:, :, None] == groups[0][:, None])
    allow = allow & ~own | own & ~(allow & ~own).any(-1, keepdim=True)  # (H, N, N) in sorted order
    inverse = order[0, 0].argsort()
    ref = reference_attention(Inputs.of(q, k, v, scale=0.5), allow[:, inverse][:, :, inverse], rel=rel)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_ranges_given_for_one_batch_entry_stand_for_every_entry() -> None:
    B, H, N, D = 2, 2, 12, 4
    q, k, v = rand_qkv(B, H, N, D, grad=False)
    g = torch.Generator().manual_seed(4)
    hi = torch.randint(0, N + 1, (1, H, N), generator=g)
    lo = (hi - 3).clamp_min(0)
    order = torch.randperm(N, generator=g).expand(1, 1, N)
    pos = torch.arange(N).expand(1, 1, N)
    spans, key_order = Ranges(lo, hi, 3, query_pos=pos, key_pos=pos), KeyOrder(order, order.argsort(-1))
    rel = rand_rel(D, 2)
    out, _ = FUSED.ranges(Inputs(q, k, v, 0.5), spans, order=key_order, rel_pos=rel)
    tiles, _ = TILES.ranges(Inputs(q, k, v, 0.5), spans, order=key_order, rel_pos=rel)
    full = [x.expand(B, H, N) for x in (lo, hi, pos, order)]
    expanded, _ = FUSED.ranges(Inputs(q, k, v, 0.5), Ranges(full[0], full[1], 3, query_pos=full[2], key_pos=full[2]),
                               order=KeyOrder(full[3], full[3].argsort(-1)), rel_pos=rel)
    torch.testing.assert_close(out, tiles, rtol=1e-10, atol=1e-10)
    assert torch.equal(out, expanded)


@pytest.mark.parametrize("executor", ["fused", "tiles"])
@pytest.mark.parametrize("what", ["order of 3 batch entries", "groups of 3 heads", "positions one short",
                                  "order 2-D"])
def test_per_position_values_that_do_not_broadcast_are_refused_by_name(executor: str, what: str) -> None:
    B, H, N = 2, 2, 13
    q, k, v = rand_qkv(B, H, N, 4, grad=False)
    order = torch.arange(N).expand(B, H, N)
    groups = torch.zeros(B, H, N, dtype=torch.long)
    positions = order
    if what == "order of 3 batch entries":
        order, name = torch.arange(N).expand(3, H, N), "Tiling.order"
    elif what == "groups of 3 heads":
        groups, name = torch.zeros(B, 3, N, dtype=torch.long), "KeyRestrictions.groups"
    elif what == "positions one short":
        positions, name = torch.arange(N - 1).expand(B, H, N - 1), "Distances.positions"
    else:
        order, name = torch.arange(N).expand(H, N), "Tiling.order"
    tiling = Tiling(block=4, back=1, offsets=(-4, 0))
    if what == "order 2-D":  # Tiling refuses it where the value is made
        with pytest.raises(ValueError, match="Tiling.order must be an integer"):
            dataclasses.replace(tiling, order=order)
        return
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r" must be \(B, H, N\)"):
        get_executor(executor).tiled(Inputs(q, k, v, 0.5), dataclasses.replace(tiling, order=order),
                                     restrict=KeyRestrictions(groups=groups),
                                     rel=RelTerms(rand_rel(4, 2), Distances(positions=positions)))


@pytest.mark.parametrize("what", ["hi beyond the keys", "lo negative", "lo above hi", "key order repeats",
                                  "lo for 3 heads", "query positions one short"])
def test_malformed_ranges_are_errors(what: str) -> None:
    B, H, N = 2, 2, 10
    q, k, v = rand_qkv(B, H, N, 4, grad=False)
    lo, hi = torch.zeros(B, H, N, dtype=torch.long), torch.full((B, H, N), 3)
    order = torch.arange(N).expand(B, H, N).clone()
    pos = torch.arange(N).expand(B, H, N)
    error, match = RuntimeError, "routeformer_fused.ranges_forward: lo and hi must have 0 <= lo <= hi <= N"
    if what == "hi beyond the keys":
        hi[1, 0, 4] = N + 1
    elif what == "lo negative":
        lo[0, 1, 0] = -1
    elif what == "lo above hi":
        lo[0, 0, 2] = 4
    elif what == "key order repeats":
        order[1, 1, 3] = 0
        match = "key_order must hold a permutation"
    elif what == "lo for 3 heads":
        lo, error, match = torch.zeros(B, 3, N, dtype=torch.long), ValueError, r"Ranges\.lo must be \(B, H, M\)"
    else:
        pos, error, match = pos[..., 1:], ValueError, r"Ranges\.query_pos must be \(B, H, Nq\)"
    with pytest.raises(error, match=match):
        FUSED.ranges(Inputs(q, k, v, 0.5), Ranges(lo, hi, 3, query_pos=pos, key_pos=torch.arange(N).expand(B, H, N)),
                     order=KeyOrder(order, order))


def test_malformed_lsh_rounds_are_errors() -> None:
    """lsh_attention checks its own arguments; the rounds operator behind it refuses rounds that do not fit."""
    B, H, N, D = 2, 2, 12, 4
    q, _, v = rand_qkv(B, H, N, D, grad=False)
    with pytest.raises(ValueError, match="q, k and v must have the same shape"):
        lsh_attention(Inputs.of(q, q, v[:, :, :5]), LSHOptions(buckets=4, rounds=2, window=3), "fused")
    with pytest.raises(ValueError, match="rotations must have shape"):
        lsh_attention(Inputs.of(q, q, v), LSHOptions(buckets=4, rounds=2, window=3), "fused",
                      rotations=torch.randn(H, 2, D, 3))
    order = torch.arange(N).expand(B, H, 2, N)
    groups = torch.zeros(B, H, 2, N, dtype=torch.long)
    with pytest.raises(RuntimeError, match="rounds_forward: order must hold a permutation"):
        fused_rounds(q, None, v, HashRounds(order * 2, groups, groups), window=3, causal=True, scale=0.5)
    with pytest.raises(RuntimeError, match=r"rounds_forward: labels must be \(B, H, R, N\)"):
        fused_rounds(q, None, v, HashRounds(order, groups, groups[:1]), window=3, causal=True, scale=0.5)
    with pytest.raises(RuntimeError, match=r"rounds_forward: key_valid must be \(B, 1 or H, N\)"):
        fused_rounds(q, None, v, HashRounds(order, groups, groups), window=3, causal=True, scale=0.5,
                     key_valid=torch.ones(1, 1, N, dtype=torch.bool))


def test_rows_that_overlap_or_are_strided_are_copied_by_the_front_end() -> None:
    """q with every position the same row (stride 0) and k, v with strided last dimensions: the front end hands the
    kernel rows it can give BLAS, and the result is the tiles executor's."""
    B, H, N, D = 2, 2, 11, 4
    q0, k0, v0 = rand_qkv(B, H, N, 2 * D, grad=False)
    q = q0[:, :, :1, :D].expand(B, H, N, D)
    k, v = k0[..., ::2], v0[..., 1::2]
    torch.testing.assert_close(local_attention(Inputs.of(q, k, v), LocalOptions(4), "fused"),
                               local_attention(Inputs.of(q, k, v), LocalOptions(4), "tiles"),
                               rtol=1e-10, atol=1e-10)
