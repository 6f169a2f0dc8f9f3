"""DeepSeek-V4-Flash priced by step time (measurement/dsv4_price.py, `bench --dsv4-price`, the
doctor's DSV4 rows): bytes derived from the real bundle's config and bit plan, the projection
being step_time's own, and both faces printing it."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from mlx.utils import tree_flatten

import bitnest_mlx
from bitnest_mlx.cli import bench, doctor, doctor_launch
from bitnest_mlx.formats import dsv4_synthetic, mxtq
from bitnest_mlx.measurement import dsv4_price
from bitnest_mlx.runtime import step_time
from bitnest_mlx.runtime.demo import demo_bundle_path
from bitnest_mlx.runtime.step_kernels import STORED_DSV4


@pytest.fixture(scope="module")
def flash() -> dict:
    return dsv4_price.flash_config()


def _with_bits(config: dict, key: str, bits: int) -> dict:
    """A copy of `config` with routed unit `key` at `bits` wherever the bundle states its plan."""
    out = copy.deepcopy(config)
    for holder in (out, out.get("quantization") or {}):
        plan = (holder.get("routed_expert_bit_plan") or {}).get("assignment")
        if plan is not None:
            plan[key] = bits
    return out


def test_the_shipped_config_is_flash_as_the_synthetic_bundles_model_it(flash):
    # The real config (verbatim from the bundle) and the synthetic bundles' Flash agree.
    assert {k: flash[k] for k in dsv4_synthetic.FLASH_CONFIG} == dsv4_synthetic.FLASH_CONFIG
    plan = flash["routed_expert_bit_plan"]["assignment"]
    assert len(plan) == 3 * flash["num_hidden_layers"]
    for key, bits in plan.items():
        layer, proj = key.removeprefix("layer_").split(".")
        assert dsv4_synthetic.flash_bits(int(layer), proj) == bits


def test_bytes_per_token_grow_with_context_and_equal_the_sum_of_their_parts(flash):
    contexts = (1, 128, 2048, 2052, 8192, 65536)
    priced = [dsv4_price.token_bytes(flash, t) for t in contexts]
    for p in priced:
        parts = sum(p["weights"].values()) + sum(p["cache"].values())
        assert p["total"] == pytest.approx(parts, rel=1e-12)
        assert set(p["weights"]) == set(dsv4_price.WEIGHT_PARTS)
        assert set(p["cache"]) == set(dsv4_price.CACHE_PARTS)
    totals = [p["total"] for p in priced]
    assert totals == sorted(totals) and totals[-1] > totals[0]
    # The indexer scores (its keys and its query weights are read) only past index_topk entries:
    # 2048 // 4 = 512 entries is all of them, 2052 // 4 = 513 is not.
    at = dict(zip(contexts, priced))
    assert at[2048]["cache"]["indexer_keys"] == 0 < at[2052]["cache"]["indexer_keys"]
    assert at[2052]["weights"]["indexer"] > at[2048]["weights"]["indexer"]
    # At 64k, from the schedule of ratios: every ratio-128 entry and the top 512 ratio-4 ones.
    ratios = flash["compress_ratios"][: flash["num_hidden_layers"]]
    entries = ratios.count(128) * (65536 // 128) + ratios.count(4) * 512
    assert at[65536]["cache"]["compressed_entries"] == entries * flash["head_dim"] * 2
    window = flash["num_hidden_layers"] * flash["sliding_window"] * flash["head_dim"] * 2
    assert at[65536]["cache"]["window"] == window
    # Reading every visible ratio-4 entry (the masked attention) costs more at 64k only.
    every = dsv4_price.token_bytes(flash, 65536, selected_only=False)["total"]
    assert every > at[65536]["total"]
    assert dsv4_price.token_bytes(flash, 2048, selected_only=False)["total"] == at[2048]["total"]


def test_routed_expert_bytes_follow_the_bit_plan(flash):
    key, before, after = "layer_5.gate_proj", 2, 4
    assert flash["routed_expert_bit_plan"]["assignment"][key] == before
    changed = _with_bits(flash, key, after)
    base = dsv4_price.weight_bytes(flash, 2048)
    new = dsv4_price.weight_bytes(changed, 2048)
    # One expert's gate_proj is [moe_intermediate_size, hidden_size]; the token reads top_k of
    # them. Independently, from the format's own packing and codebook.
    rows, cols, k = flash["moe_intermediate_size"], flash["hidden_size"], 6
    row = {b: mxtq.pack_codes(np.zeros((1, cols), np.uint32), b).nbytes for b in (before, after)}
    table = {b: mxtq.codebook(cols, b).nbytes for b in (before, after)}
    assert new["routed_experts"] - base["routed_experts"] == k * rows * (row[after] - row[before])
    assert new["mxtq_tables"] - base["mxtq_tables"] == table[after] - table[before]
    rest = [p for p in dsv4_price.WEIGHT_PARTS if p not in ("routed_experts", "mxtq_tables")]
    assert all(new[p] == base[p] for p in rest)
    # And the whole routed read is the plan: top-k experts' codes and fp16 row norms per unit.
    shape = {"gate_proj": (rows, cols), "up_proj": (rows, cols), "down_proj": (cols, rows)}
    want = sum(
        k * (o * i * bits // 8 + 2 * o)
        for unit, bits in flash["routed_expert_bit_plan"]["assignment"].items()
        for o, i in [shape[unit.split(".")[1]]]
    )
    assert base["routed_experts"] == want


def test_priced_weights_equal_the_loaded_demo_bundles_parameters_a_token_reads():
    path = demo_bundle_path()
    config = dsv4_price.read_config(path)
    model, _ = bitnest_mlx.load(path)  # float32, as the loader holds a bundle by default
    k, n_experts = config["num_experts_per_tok"], config["n_routed_experts"]
    read = 0.0
    for name, a in tree_flatten(model.parameters()):
        if name.startswith("embed.") or name.endswith((".ape", ".tid2eid")):
            read += a.nbytes / a.shape[0]  # one row: the token's, its position in the block
        elif ".switch_mlp." in name:
            read += 0 if name.endswith(".tq_bits") else a.nbytes * k / n_experts
        else:
            read += a.nbytes
    # Past index_topk ratio-4 entries, so the indexer scores and its weights are read.
    priced = dsv4_price.weight_bytes(config, 4096, dtype_bytes=4)
    assert sum(priced.values()) - priced["mxtq_tables"] == pytest.approx(read, rel=1e-12)


def test_the_projection_is_step_time_of_the_stated_step(flash):
    r = dsv4_price.price(flash)
    assert len(r["rows"]) == len(dsv4_price.CHIPS) * len(dsv4_price.CONTEXTS) * 2
    for row in r["rows"]:
        kernels = STORED_DSV4[row["path"]].per_layer * 43 + STORED_DSV4[row["path"]].outside
        assert row["kernels"] == pytest.approx(kernels) and row["syncs"] == 1
        step = step_time.Step(row["gb"] * 1e9, kernels, 1)
        seconds = step_time.step_seconds(step, row["chip"])
        assert row["tokens_per_second"] == pytest.approx(1 / seconds, rel=1e-9)
        terms = {t: row[f"{t}_ms"] for t in ("bytes", "kernels", "syncs")}
        assert sum(terms.values()) == pytest.approx(seconds * 1e3, rel=1e-9)
        assert row["bound"] == max(terms, key=terms.get)
    assert "fitted" in r["constants"]["M4 Max"]["provenance"]
    assert r["constants"]["M3 Ultra"]["provenance"].startswith("assumed")
    a = r["acceptance"]
    ultra = next(
        x for x in r["rows"] if (x["chip"], x["context"], x["path"]) == ("M3 Ultra", 2048, "kernel")
    )
    assert a["projected_tokens_per_second"] == ultra["tokens_per_second"]
    assert a["met"] == (ultra["tokens_per_second"] >= 44.0)


def test_bench_dsv4_price_prints_the_table_and_json_and_prices_another_config(
    flash, tmp_path, capsys
):
    assert bench.main(["--dsv4-price"]) == 0
    text = capsys.readouterr().out
    assert "| M3 Ultra | 2k | kernel |" in text and "issue 51: M3 Ultra at 2k" in text
    assert "ds4 (q2) 44.1" in text
    assert bench.main(["--dsv4-price", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["config"] == dsv4_price.FLASH_CONFIG_FILE
    # --model: a config.json of its own (every routed unit at 4 bits reads more).
    heavier = flash
    for unit in flash["routed_expert_bit_plan"]["assignment"]:
        heavier = _with_bits(heavier, unit, 4)
    (tmp_path / "config.json").write_text(json.dumps(heavier))
    assert bench.main(["--dsv4-price", "--json", "--model", str(tmp_path)]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["bytes"]["2048"]["total"] > default["bytes"]["2048"]["total"]
    broken = {**flash, "hidden_size": "wide"}
    (tmp_path / "config.json").write_text(json.dumps(broken))
    assert bench.main(["--dsv4-price", "--model", str(tmp_path)]) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_doctor_prices_dsv4_on_the_measured_step_costs(flash):
    costs = {"t_kernel_us": 5.0, "t_sync_us": 40.0}
    d = doctor_launch.dsv4_report(costs, "Apple M3 Ultra")
    assert d["chip"] == "M3 Ultra" and d["bandwidth_gbs"] == 819
    measured = step_time.constants("M3 Ultra", t_kernel=5e-6, t_sync=40e-6)
    for row in d["rows"]:
        step = dsv4_price.flash_step(flash, row["context"], row["path"])
        assert row["kernels"] == dsv4_price.kernels_per_token(flash, row["path"])
        assert row["syncs"] == 1
        assert row["tokens_per_second"] == pytest.approx(1 / step_time.step_seconds(step, measured))
    text = "\n".join(doctor_launch.dsv4_markdown(d))
    assert "| 2048 | kernel | 1710 | 1 |" in text
    unknown = doctor_launch.dsv4_report(costs, None)
    assert unknown["chip"] is None and unknown["bandwidth"].startswith("assumed")


def test_doctor_report_has_the_dsv4_rows_in_markdown_and_json(monkeypatch):
    # The slow sections stubbed: this checks the wiring of the DSV4 rows into the report.
    monkeypatch.setattr(
        doctor,
        "kernel_report",
        lambda *a: {
            "runner": None,
            "available": False,
            "reason": "-",
            "compiled": {},
            "checks": [],
        },
    )
    decode = {"model": "demo", "prompt": "x", "max_tokens": 4, "kernels_vs_pure": None}
    decode |= {"draft_tps": 1.0, "target_tps": 1.0, "speculative_tps": 1.0, "acceptance": 1.0}
    monkeypatch.setattr(doctor, "decode_report", lambda *a, **k: decode)
    monkeypatch.setattr(doctor, "verify_report", lambda *a: {})
    monkeypatch.setattr(doctor, "verify_markdown", lambda v: [])
    report = doctor.collect(doctor.build_parser().parse_args(["--repeats", "5"]))
    d = report["dsv4_projection"]
    assert d["t_kernel_us"] == report["step_costs"]["t_kernel_us"]
    assert [r["kernels"] for r in d["rows"][:2]] == [
        dsv4_price.kernels_per_token(dsv4_price.flash_config(), p) for p in ("kernel", "pure")
    ]
    assert "## DeepSeek-V4-Flash on these step costs" in doctor.markdown(report)
    assert json.loads(json.dumps(report))["dsv4_projection"]["rows"][0]["syncs"] == 1
