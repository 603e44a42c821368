"""TransformerConfig: defaults, the attention spec, and every bad configuration named clearly."""

from __future__ import annotations

import pytest

from routeformer import TransformerConfig
from routeformer.model import parse_attention


def test_defaults_are_half_local_half_routing_and_derived_fields_resolved() -> None:
    c = TransformerConfig()
    assert c.attention == "local:4,routing:4"
    assert c.head_dim == c.dim // c.heads
    assert c.num_clusters == 32 and c.stride == 32 and c.rel_clip == c.window
    # the balanced two-probe rule, N / k keys per query in all: 2 probes of 16
    assert c.routing_probes == 2 and c.routing_window == 16 and c.routing_balance > 0 and c.routing_warmup == 0
    assert TransformerConfig(routing_probes=1).routing_window == 32


def test_json_round_trip(tmp_path) -> None:
    c = TransformerConfig(vocab_size=100, dim=64, heads=4, seq_len=256, window=32,
                          attention=["local", "local:2,routing:2"], depth=2, positions="absolute")
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
    ({"window": 2048}, r"window \(2048\) is larger than seq_len \(1024\)"),
    ({"attention": "fixed", "block": 2048}, r"block \(2048\) is larger than seq_len"),
    ({"attention": "strided", "stride": 4096}, r"stride \(4096\) is larger than seq_len"),
    ({"attention": "routing", "routing_window": 5000}, r"routing_window \(5000\) is larger than seq_len"),
    ({"summary": 200, "block": 128}, r"summary \(200\) must be at most block \(128\)"),
    ({"positions": "rotary"}, "positions must be one of relative, absolute, factorized, none"),
    ({"activation": "relu"}, "activation must be one of sigmoid_gelu, gelu"),
    ({"dropout": 1.5}, r"dropout must be in \[0, 1\)"),
    ({"depth": 0}, "depth must be a positive integer, got 0"),
    ({"vocab_size": 2.5}, "vocab_size must be a positive integer"),
    ({"global_tokens": [5000]}, r"global_tokens must lie in \[0, seq_len=1024\)"),
    ({"attention": "longformer", "dilation": [1, 2]}, "dilation gives 2 values but there are 8 longformer heads"),
    ({"image_shape": [64, 64]}, r"image_shape must be \(rows, columns, channels\)"),
    ({"checkpointing": "yes"}, "checkpointing must be true or false"),
    ({"separate_routing": 1}, "separate_routing must be true or false"),
    ({"separate_routing": True}, "separate_routing=True routes queries and keys apart, which needs shared_qk=False"),
    ({"kmeans_decay": 1.0}, r"kmeans_decay must be in \[0, 1\)"),
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
