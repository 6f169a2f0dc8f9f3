"""DeepSeek-V4 memory: the synthetic bundle at Flash's dimensions, lean loading, and the expert
memory budget (routed experts on disk behind an LRU), on small bundles."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from bitnest_mlx import load
from bitnest_mlx.cli import make_bundle
from bitnest_mlx.formats import dsv4_bundle, dsv4_bundle_write, dsv4_synthetic
from bitnest_mlx.layers.expert_store import ExpertStore, expert_source, tensor_ranges
from bitnest_mlx.layers.mxtq_linear import MXTQSwitchLinear
from bitnest_mlx.measurement import dsv4_bench
from bitnest_mlx.runtime.demo import TINY_CONFIG, random_weights
from bitnest_mlx.runtime.loader import ExpertBudgetError

TOKENS = mx.array(np.random.default_rng(3).integers(2, 256, (1, 16)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer synthetic bundle at toy size (Flash layers 3-4: ratios 128 and 4, 2/2/4 bits),
    written through the CLI entry, in several shards."""
    out = tmp_path_factory.mktemp("syn") / "tiny"
    assert (
        make_bundle.main(
            [
                "make-bundle",
                "--tiny",
                "--layers",
                "2",
                "--out",
                str(out),
                "--max-shard-gb",
                "0.0002",
            ]
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    """The demo config's first 3 layers (hash, ratio 4) with experts stored one per tensor."""
    config = dict(TINY_CONFIG, num_hidden_layers=3)
    path = tmp_path_factory.mktemp("pe") / "b"
    bits = {
        f"layer_{i}.{p}": 2 + 2 * (p == "down_proj")
        for i in range(3)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    return dsv4_bundle_write.write(
        path, config, random_weights(config, 1), expert_bits=bits, per_expert=True
    )


def _decode(model, tokens=TOKENS) -> np.ndarray:
    """Prefill half, then one token at a time: the logits of every position."""
    cache = model.make_cache()
    half = tokens.shape[1] // 2
    out = [np.array(model(tokens[:, :half], cache))[0]]
    out += [np.array(model(tokens[:, t : t + 1], cache))[0] for t in range(half, tokens.shape[1])]
    return np.concatenate(out)


# ---------------------------------------------------------------- synthetic bundle


def test_synthetic_bundle_is_a_strict_bundle_with_the_flash_window_schedule(tiny):
    bundle = dsv4_bundle.read(tiny)
    config = bundle.config
    assert config["compress_ratios"] == [128, 4] and config["num_hash_layers"] == 0
    experts = {k: v for k, v in bundle.formats.items() if isinstance(v, int)}
    assert experts == {
        f"layers.{i}.ffn.switch_mlp.{p}": 4 if p == "down_proj" else 2
        for i in range(2)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert {v for k, v in bundle.formats.items() if k not in experts} == {"affine"}
    assert len(list(tiny.glob("*.safetensors"))) > 2
    logits = np.array(load(tiny)[0](TOKENS))
    assert np.isfinite(logits).all() and logits.std() > 0


def test_synthetic_config_has_flash_dimensions_and_its_bit_plan():
    config = dsv4_synthetic.synthetic_config(2)
    flash = dsv4_synthetic.FLASH_CONFIG
    for key in (
        "hidden_size",
        "n_routed_experts",
        "moe_intermediate_size",
        "head_dim",
        "num_attention_heads",
        "index_n_heads",
        "hc_mult",
        "vocab_size",
    ):
        assert config[key] == flash[key]
    assert (config["hidden_size"], config["n_routed_experts"], config["vocab_size"]) == (
        4096,
        256,
        129280,
    )
    # The rule reproduces the q3.4 plan's counts: 39 units at 2 bits, 90 at 4 (3.3953 bits).
    bits = [
        dsv4_synthetic.flash_bits(i, p)
        for i in range(43)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]
    assert (bits.count(2), bits.count(4)) == (39, 90)
    # Two real layers are ~5.8 GB of tensors, 4.3 GB of them routed-expert codes.
    slots = dsv4_bundle.schedule(config)
    codes = sum(
        int(np.prod(s.shape))
        * dsv4_synthetic.flash_bits(3 + int(n.split(".")[1]), n.rsplit(".", 1)[1])
        // 8
        for n, s in slots.items()
        if s.kind == "experts"
    )
    assert codes == 2 * 256 * 2048 * 4096 * (2 + 2 + 4) // 8


def test_synthetic_bundle_writing_is_deterministic(tiny, tmp_path):
    again = dsv4_synthetic.write(tmp_path / "again", 2, tiny=True, max_shard_bytes=200_000)
    for f in tiny.glob("*.safetensors"):
        assert (again / f.name).read_bytes() == f.read_bytes()


# ---------------------------------------------------------------- lean loading


def test_loading_holds_each_weight_once_as_stored(tiny):
    model, _ = load(tiny)
    params = dict(tree_flatten(model.parameters()))
    sizes = dsv4_bench.bundle_bytes(tiny)
    assert sum(a.nbytes for a in params.values()) <= 1.05 * sizes["tensor_bytes"]
    # The only float arrays are the float slots (norms, router, hc_*, ...) and the scales,
    # biases and norms of quantized ones: no float `.weight` of an affine or MXTQ tensor.
    slots = dsv4_bundle.schedule(json.loads((tiny / "config.json").read_text()))
    for name, a in params.items():
        if a.dtype in (mx.float32, mx.float16, mx.bfloat16):
            leaf = name.rpartition(".")[2]
            assert name in slots or leaf in ("scales", "biases", "tq_norms"), name
    # Codes, scales and norms keep their stored dtype (only the embedding's scales widen).
    assert params["layers.0.attn.wq_b.scales"].dtype == mx.float16
    assert params["layers.0.ffn.switch_mlp.gate_proj.tq_norms"].dtype == mx.float16


# ---------------------------------------------------------------- expert budget


def test_budgeted_logits_are_bit_identical_with_evictions(tiny):
    resident = _decode(load(tiny)[0])
    model, _ = load(tiny, max_expert_memory=8e-6)  # 8 kB: a few experts, constant eviction
    store = model.expert_store
    assert np.array_equal(_decode(model), resident)
    s = store.stats()
    assert s["misses"] > 0 and s["cached_bytes"] <= store.budget_bytes
    names = dict(tree_flatten(model.parameters()))
    assert not any(k.endswith(".tq_packed") for k in names)


def test_budgeted_per_expert_bundle_and_grouped_prefill_are_bit_identical(per_expert):
    plain, _ = load(per_expert)
    budget, _ = load(per_expert, max_expert_memory=1e-5)
    assert np.array_equal(_decode(budget), _decode(plain))
    for m in (plain, budget):  # force the prefill path that expands a few experts at a time
        for layer in m.layers:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.ffn.switch_mlp, proj).max_dequant_bytes = 1
    assert np.array_equal(np.array(budget(TOKENS)), np.array(plain(TOKENS)))


def test_store_counts_hits_misses_and_bytes_and_evicts_least_recent(tiny):
    ranges = tensor_ranges(tiny)
    name = "layers.0.ffn.switch_mlp.gate_proj"
    source = expert_source(ranges, name, 16)
    resident = dsv4_bundle.read(tiny).tensors[f"{name}.tq_packed"]
    one = source.expert_bytes
    store = ExpertStore(budget_bytes=3 * one)
    assert np.array_equal(
        np.array(store.fetch(source, [1, 5])), np.array(resident[mx.array([1, 5])])
    )
    store.fetch(source, [5, 7])  # 5 hits; 1 is now least recent
    store.fetch(source, [9])  # 4 experts > budget: evicts 1
    assert (store.hits, store.misses, store.bytes_read) == (1, 4, 4 * one)
    assert store.cached_bytes == 3 * one
    store.fetch(source, [5, 1])
    assert (store.hits, store.misses) == (2, 5)
    assert store.stats()["hit_rate"] == pytest.approx(2 / 7)


def test_a_budget_on_a_bitnest_package_is_refused():
    from bitnest_mlx.runtime.demo import demo_path

    with pytest.raises(ExpertBudgetError):
        load(demo_path(), max_expert_memory=1.0)


def test_mxtq_layer_with_store_drops_its_codes_parameter(tiny):
    layer = MXTQSwitchLinear(64, 64, 16, 2)
    layer.use_store(
        ExpertStore(0), expert_source(tensor_ranges(tiny), "layers.0.ffn.switch_mlp.gate_proj", 16)
    )
    assert set(dict(tree_flatten(layer.parameters()))) == {"tq_norms", "tq_bits"}


def test_bench_json_reports_peak_rss_budget_stats_parts_and_mlx_lm_experts(tiny, capsys):
    from bitnest_mlx.cli import bench

    argv = [
        "--model",
        str(tiny),
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "3",
        "--json",
        "--max-expert-memory",
        "0.00001",
        "--parts",
        "--peer-experts",
        "4",
    ]
    assert bench.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    m = r["memory"]
    assert m["peak_bytes"] >= m["rss_after_load_bytes"] > 0
    assert m["expert_code_bytes"] + m["non_expert_bytes"] == m["tensor_bytes"]
    assert m["peak_over_non_expert_plus_budget"] > 0
    store = r["decode"]["expert_store"]
    assert 0 <= store["hit_rate"] <= 1 and store["bytes_read_per_token"] > 0
    assert r["decode_bytes_per_token"]["routed_experts"] > 0
    assert set(r["parts"]["ms"]) >= {
        "router",
        "indexer",
        "compressor",
        "routed_experts",
        "hyper_connections",
        "other",
    }
    peers = r["experts_vs_mlx_lm"]["ms_per_layer_token"]
    assert set(peers) == {"mxtq_2/2/4", "mxtq_2", "mxtq_4", "mlx_lm_affine_2", "mlx_lm_affine_4"}
