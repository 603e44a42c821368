"""TransformerConfig: defaults, the attention spec, and every bad configuration named clearly."""

from __future__ import annotations

import json

import pytest

from routeformer import TransformerConfig
from routeformer.attention.local import LocalOptions
from routeformer.attention.routing.kind import RoutingOptions
from routeformer.model import parse_attention
from routeformer.model.legacy import MOVED, new_spelling


def test_defaults_are_half_local_half_routing_and_derived_fields_resolved() -> None:
    c = TransformerConfig()
    assert c.attention == "local:4,routing:4"
    assert c.head_dim == c.dim // c.heads
    assert c.grid_width == 32 and c.rel_clip == c.options["local"].window == 128
    routing = c.options["routing"]
    assert isinstance(routing, RoutingOptions) and isinstance(c.options["local"], LocalOptions)
    # the balanced two-probe rule, N / k keys per query in all: 2 probes of 16
    assert routing.num_clusters == 32 and routing.probes == 2 and routing.window == 16 and routing.balance > 0
    assert routing.warmup == 0
    assert TransformerConfig(options={"routing": {"probes": 1}}).options["routing"].window == 32
    assert set(c.options) == {"local", "routing"}  # only the kinds in use get their defaults


def test_options_of_kinds_not_in_use_are_checked_and_kept_but_not_completed() -> None:
    c = TransformerConfig(attention="full", options={"lsh": {"rounds": 4}})
    assert c.options["lsh"].rounds == 4 and c.options["lsh"].buckets is None  # kept for another attention mix
    with pytest.raises(ValueError, match=r"options.lsh: rounds must be a positive integer"):
        TransformerConfig(attention="full", options={"lsh": {"rounds": 0}})


@pytest.mark.parametrize("old, new", [
    ({"window": 64}, {"options": {"local": {"window": 64}}, "rel_clip": 64}),
    ({"num_clusters": 8, "routing_window": 12, "routing_probes": 1, "routing_balance": 0.0, "shared_qk": False,
      "separate_routing": True, "routing_warmup": 10, "routing_warmup_len": 256, "routing_gate": True,
      "commitment": 0.0, "kmeans_decay": 0.99},
     {"options": {"routing": {"num_clusters": 8, "window": 12, "probes": 1, "balance": 0.0, "shared_qk": False,
                              "separate": True, "warmup": 10, "warmup_len": 256, "gate": True, "commitment": 0.0,
                              "decay": 0.99}}}),
    ({"attention": "strided", "stride": 16}, {"attention": "strided", "options": {"strided": {"stride": 16}},
                                              "grid_width": 16}),
    ({"attention": "fixed_a1:4,fixed_a2:4", "block": 64, "summary": 4},
     {"attention": "fixed_a1:4,fixed_a2:4", "options": {"fixed": {"block": 64, "summary": 4}}}),
    ({"attention": "longformer", "window": 32, "dilation": 2, "global_tokens": [0]},
     {"attention": "longformer", "options": {"longformer": {"window": 32, "dilation": 2, "global_tokens": [0]}},
      "rel_clip": 32}),
    ({"attention": "local:4,linear:4", "kernel": "elu", "positions": "none"},
     {"attention": "local:4,linear:4", "options": {"local": {"kernel": "elu"}, "linear": {"kernel": "elu"}},
      "positions": "none"}),
    ({"attention": "performer", "features": 20, "redraw_every": 5, "positions": "none"},
     {"attention": "performer", "options": {"performer": {"features": 20, "redraw_every": 5}}, "positions": "none"}),
    ({"attention": "lsh", "lsh_buckets": 8, "lsh_rounds": 3, "lsh_window": 7, "positions": "none"},
     {"attention": "lsh", "options": {"lsh": {"buckets": 8, "rounds": 3, "window": 7}}, "positions": "none"}),
])
def test_old_flat_names_of_a_saved_config_are_moved_into_the_sections_of_the_kinds_in_use(
        old: dict, new: dict, tmp_path) -> None:
    assert TransformerConfig.from_dict(old, saved=True) == TransformerConfig(**new)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    assert TransformerConfig.load(path) == TransformerConfig(**new)
    name = next(key for key in old if key in MOVED)
    with pytest.raises(ValueError, match=rf"TransformerConfig: {name} is the old spelling of options\.[a-z]+\.\w+"):
        TransformerConfig(**old)  # only saved files are read in the old spelling
    with pytest.raises(ValueError, match=rf"^{name} is the old spelling of "):
        TransformerConfig.from_dict(old)


def test_old_flat_names_of_a_saved_config_reach_only_the_kinds_in_use_as_before() -> None:
    # before the move a kind's field was read by its heads only: the same here (a saved config.json lists them all)
    saved = TransformerConfig.from_dict({"attention": "full", "block": 64, "lsh_rounds": 3}, saved=True)
    assert saved == TransformerConfig(attention="full")
    with pytest.raises(ValueError, match=r"window = 64 and options.local.window = 32 both given; window is the old "
                                         r"spelling of options.local.window / options.longformer.window"):
        TransformerConfig.from_dict({"window": 64, "options": {"local": {"window": 32}}}, saved=True)


def test_the_constructor_refuses_an_old_flat_name_and_names_its_new_spelling() -> None:
    with pytest.raises(ValueError, match=r"TransformerConfig: window is the old spelling of options.local.window / "
                                         r"options.longformer.window; write that \(it also set rel_clip when rel_clip "
                                         r"was not given"):
        TransformerConfig(window=64)
    with pytest.raises(ValueError, match=r"TransformerConfig: routing_window is the old spelling of "
                                         r"options.routing.window; write that\. The flat names are read only from "
                                         r"saved run files"):
        TransformerConfig(attention="routing", routing_window=8)
    for name in MOVED:  # every old name, whatever its value
        with pytest.raises(ValueError, match=rf"TransformerConfig: {name} is the old spelling of {new_spelling(name)}"):
            TransformerConfig(**{name: None})


def test_a_config_json_saved_before_the_move_loads_as_the_same_model(tmp_path) -> None:
    old = {"vocab_size": 256, "dim": 64, "depth": 2, "heads": 4, "head_dim": 16, "seq_len": 256,
           "attention": "local:2,routing:2", "window": 32, "num_clusters": 16, "routing_window": 16,
           "shared_qk": True, "separate_routing": False, "stride": 16, "block": 128, "summary": 8, "dilation": 1,
           "global_tokens": [], "positions": "relative", "rel_clip": 32, "image_shape": None, "dropout": 0.0,
           "ff_mult": 4.0, "activation": "sigmoid_gelu", "checkpointing": False, "backend": "auto",
           "commitment": 0.0001, "kmeans_decay": 0.999, "kernel": "exp", "features": None, "redraw_every": 0,
           "lsh_buckets": None, "lsh_rounds": 2, "lsh_window": None, "options": {}}  # no routing_probes: paper's rule
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    c = TransformerConfig.load(path)
    assert c.options["local"].window == 32 and c.rel_clip == 32 and c.grid_width == 16
    assert c.options["routing"] == RoutingOptions(16, 16, probes=1, balance=0.0, warmup=0, gate=False)


def test_json_round_trip(tmp_path) -> None:
    c = TransformerConfig(vocab_size=100, dim=64, heads=4, seq_len=256, options={"local": {"window": 32}},
                          rel_clip=32, attention=["local", "local:2,routing:2"], depth=2, positions="absolute")
    c.save(tmp_path / "config.json")
    assert TransformerConfig.load(tmp_path / "config.json") == c


@pytest.mark.parametrize("spec, heads, want", [
    ("full", 8, [("full", 8)]),
    ("local:4,routing:4", 8, [("local", 4), ("routing", 4)]),
    (" strided_a1:2 , strided_a2:2 ", 4, [("strided_a1", 2), ("strided_a2", 2)]),
])
def test_parse_attention(spec: str, heads: int, want) -> None:
    assert parse_attention(spec, heads) == want


@pytest.mark.parametrize("kwargs, fragment", [
    ({"attention": "local:3,routing:4"}, "sum to 7, but heads = 8"),
    ({"attention": "local:4,sparse:4"}, "unknown mechanism 'sparse'.*allowed: full, local, routing"),
    ({"attention": "local,routing"}, "give a head count for each mechanism"),
    ({"attention": "local:4,local:4"}, "appears twice"),
    ({"attention": "local:x"}, "not an integer"),
    ({"attention": ["local"] * 3}, "3 layer specs but depth = 4"),
    ({"attention": 7}, "attention must be a spec string"),
    ({"dim": 100, "heads": 8}, r"dim \(100\) must be divisible by heads \(8\)"),
    ({"options": {"local": {"window": 2048}}, "rel_clip": 2048}, r"window \(2048\) is larger than seq_len \(1024\)"),
    ({"attention": "fixed", "options": {"fixed": {"block": 2048}}}, r"block \(2048\) is larger than seq_len"),
    ({"attention": "strided", "options": {"strided": {"stride": 4096}}, "grid_width": 4096},
     r"stride \(4096\) is larger than seq_len"),
    ({"attention": "routing", "options": {"routing": {"window": 5000}}},
     r"options.routing: window \(5000\) is larger than seq_len"),
    ({"attention": "fixed", "options": {"fixed": {"summary": 200, "block": 128}}},
     r"options.fixed: summary \(200\) must be at most block"),
    ({"positions": "rotary"}, "positions must be one of relative, absolute, factorized, none"),
    ({"activation": "relu"}, "activation must be one of sigmoid_gelu, gelu"),
    ({"dropout": 1.5}, r"dropout must be in \[0, 1\)"),
    ({"depth": 0}, "depth must be a positive integer, got 0"),
    ({"vocab_size": 2.5}, "vocab_size must be a positive integer"),
    ({"attention": "longformer", "options": {"longformer": {"global_tokens": [5000]}}},
     r"global_tokens must lie in \[0, seq_len=1024\)"),
    ({"attention": "longformer", "options": {"longformer": {"dilation": [1, 2]}}},
     "dilation gives 2 values but layer 0 has 8 longformer heads"),
    ({"image_shape": [64, 64]}, r"image_shape must be \(rows, columns, channels\)"),
    ({"checkpointing": "yes"}, "checkpointing must be true or false"),
    ({"options": {"routing": {"separate": 1}}}, "options.routing: separate must be true or false"),
    ({"options": {"routing": {"separate": True}}},
     "options.routing: separate = true routes queries and keys apart, which needs shared_qk = false"),
    ({"options": {"routing": {"decay": 1.0}}}, r"options.routing: decay must be in \[0, 1\)"),
    ({"options": {"routing": {"windw": 3}}}, r"options.routing: unknown field\(s\) \['windw'\]; routing heads take "),
    ({"options": {"sparse": {}}}, r"options: unknown section\(s\) \['sparse'\]; the registered kinds read full, "),
    ({"options": {"local": 3}}, r"options.local must be a table of field = value"),
])
def test_bad_configurations(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        TransformerConfig(**kwargs)


def test_unknown_keys_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown config keys \['widht'\]; valid keys: activation, attention, "):
        TransformerConfig.from_dict({"widht": 3})


def test_corrupt_config_file_names_the_file(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=str(path)):
        TransformerConfig.load(path)


@pytest.mark.parametrize("attention, positions", [
    ("full", "relative"), ("local", "relative"), ("routing", "relative"), ("strided_a1:4,strided_a2:4", "relative"),
    ("fixed", "relative"), ("longformer", "relative"), ("lsh", "none"), ("linear", "none"),
    ("performer", "absolute"), ("local:4,routing:4", "factorized"), ("moba", "relative"), ("nsa", "relative"),
])
def test_every_kinds_completed_options_survive_config_json(tmp_path, attention: str, positions: str) -> None:
    options = {"longformer": {"dilation": [1, 2] * 4, "global_tokens": [0, 3]}} if attention == "longformer" else {}
    c = TransformerConfig(dim=64, heads=8, seq_len=256, attention=attention, positions=positions, options=options)
    c.save(tmp_path / "config.json")
    loaded = TransformerConfig.load(tmp_path / "config.json")
    assert loaded == c and loaded.describe_heads() == c.describe_heads()
    assert json.loads((tmp_path / "config.json").read_text())["options"]  # the filled-in defaults are written
