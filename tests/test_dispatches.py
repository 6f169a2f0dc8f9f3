"""The kernel counter on the GPU basis (`bench --dispatches`): what it counts, against structures
known independently of our code."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from bitnest_mlx.models.bitnest_llama import ModelArgs

from bitnest_mlx.measurement import dispatch_graph as dg
from bitnest_mlx.measurement import dispatches as d
from bitnest_mlx.measurement import step_costs
from bitnest_mlx.measurement.speed_projection import spec_of
from bitnest_mlx.runtime.step_kernels import STORED, STORED_DSV4, PassKernels

TINY = ModelArgs(
    arch="llama",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=64,
    rms_norm_eps=1e-5,
    head_dim=64,
    group_size=64,
    r4=[{"K": 1, "fp32": False}] * 2,
    o_proj_group=64,
    kv_group=32,
    r3=True,
)


def _evaluated(*arrays):
    mx.eval(*arrays)
    return arrays


def test_each_fast_op_counts_as_one_kernel_whatever_its_cpu_fallback():
    x, w = _evaluated(mx.ones((1, 3, 64), dtype=mx.float16), mx.ones((64,), dtype=mx.float16))
    (q,) = _evaluated(mx.ones((1, 2, 3, 64), dtype=mx.float16))
    plain = dg.count([mx.fast.rms_norm(x, w, 1e-5)])
    assert plain > 1  # the CPU backend builds the fallback graph
    with dg.gpu_basis():
        assert dg.count([mx.fast.rms_norm(x, w, 1e-5)]) == 1
        rope = mx.fast.rope(q, 64, traditional=False, base=1e4, scale=1.0, offset=3)
        assert dg.count([rope]) == 1
        out = mx.fast.scaled_dot_product_attention(q, q, q, scale=0.1, mask="causal")
        assert out.shape == q.shape and dg.count([out]) == 1
        # Each stand-in depends on its inputs: the work before it is still counted.
        assert dg.count([mx.fast.rms_norm(x * 2, w, 1e-5)]) == 2


def test_views_are_free_and_each_call_of_a_compiled_function_is_one_kernel():
    f = mx.compile(lambda a: mx.exp(a * 3 + 1) - 2)
    (x,) = _evaluated(mx.ones((4, 8)))
    assert dg.count([x.T.reshape(32)[:5]]) == 0
    assert dg.count([f(x)]) == 1
    # Calls share one primitive object: counting by primitive would see one kernel here.
    assert dg.count([f(f(x)), f(x + 1)]) == 4


def test_host_syncs_and_the_kernels_they_evaluate_are_counted():
    (x,) = _evaluated(mx.ones((1,)))
    with dg.gpu_basis() as ledger:
        y = x * 2 + 1
        mx.eval(y)
        y.item()  # evaluated already: a read, no sync
        (y - 1).item()
        mx.async_eval(y * 3)  # launched, not waited for
    assert ledger.syncs == [2, 1]
    assert ledger.launched == 4


def test_mlx_lm_llama_launches_its_seventeen_kernels_per_layer():
    # 2 norms, q/k/v, 2 RoPE, 2 cache writes, attention, o_proj, 2 residual adds, gate, up, the
    # compiled SwiGLU and down: mlx-lm's llama.py read independently of the counter.
    c = d.count_mlx_lm_llama(TINY, bits=8)
    assert c.per_layer == 17
    assert c.per_layer_parts["projection"] == 7 and c.per_layer_parts["attention"] == 1


@pytest.fixture(scope="module")
def bitnest_counts() -> dict:
    return d.count_bitnest(TINY)


def test_bitnest_parts_add_up_and_the_kernel_path_launches_fewer_than_the_pure_path(
    bitnest_counts,
):
    counts = bitnest_counts
    for path in ("kernel", "pure"):
        for step in ("draft", "target", "verify_4"):
            c = counts[path][step]
            assert sum(c.per_layer_parts.values()) == c.per_layer
            assert c.per_layer_parts["norm"] == 2  # two RMSNorms a layer, one kernel each
    assert counts["kernel"]["target"].per_layer < counts["pure"]["target"].per_layer
    # A verify pass launches the kernels of a step; past A8_IN_KERNEL_MAX_ROWS rows each of the
    # layer's 4 projection inputs (q/k/v, o, gate/up, down) is quantized by its own launch first.
    target = counts["kernel"]["target"].per_layer
    assert counts["kernel"]["verify_2"].per_layer == target
    assert counts["kernel"]["verify_8"].per_layer == target + 4
    # The round: γ draft steps and one verify pass at least, and its host syncs seen.
    r = counts["kernel"][f"round_gamma_{d.ROUND_GAMMA}"]
    assert r.per_layer >= (d.ROUND_GAMMA + 1) * counts["kernel"]["target"].per_layer - 1e-9
    assert r.syncs >= 1


def test_the_runtimes_stored_kernels_are_the_counters_on_the_demos_structure(bitnest_counts):
    # The controller plans with step_kernels.STORED (counting at load time would take minutes):
    # a cut to the kernels updates the table, or this fails. TINY is the demo's structure.
    demo = ModelArgs.from_spec(spec_of("demo"))
    same = ("arch", "biased", "r3", "k_bias_offset", "smoothing", "draft_vocab")
    assert all(getattr(demo, f) == getattr(TINY, f) for f in same)
    assert [r["K"] for r in demo.r4] == [r["K"] for r in TINY.r4[:1]] * demo.num_hidden_layers
    counted = step_costs.path_kernels(bitnest_counts)
    assert counted == STORED, f"update runtime/step_kernels.py STORED to {counted}"


def test_the_runtimes_stored_bundle_kernels_are_the_counters_on_the_demo_bundle():
    from bitnest_mlx.runtime.demo import demo_bundle_path

    counted = {
        p: PassKernels(c.per_layer, c.outside) for p, c in d.count_dsv4(demo_bundle_path()).items()
    }
    assert counted == STORED_DSV4, f"update runtime/step_kernels.py STORED_DSV4 to {counted}"


def test_the_counter_leaves_mlx_as_it_found_it():
    fns = (mx.eval, mx.async_eval, mx.fast.rms_norm, mx.array.item, nn.QuantizedLinear.__call__)
    with dg.gpu_basis(parts=d.mlx_lm_parts()):
        assert mx.eval is not fns[0]
    assert (mx.eval, mx.async_eval, mx.fast.rms_norm, mx.array.item) == fns[:4]
    assert nn.QuantizedLinear.__call__ is fns[4]


def test_target_only_decoding_syncs_once_a_token_with_the_next_step_launched_before():
    import bitnest_mlx
    from bitnest_mlx.runtime.speculative import speculative_generate_step

    model, _ = bitnest_mlx.load("demo")
    prompt = mx.array([5, 6, 7], dtype=mx.uint32)
    want = [
        t for t, _, _ in speculative_generate_step(prompt, model, max_tokens=6, num_draft_tokens=0)
    ]
    with dg.gpu_basis() as ledger:
        steps = speculative_generate_step(prompt, model, max_tokens=6, num_draft_tokens=0)
        next(steps)
        prefill_syncs = 1  # the prompt's cache, written before the first step
        assert len(ledger.syncs) == prefill_syncs + 1
        for _ in steps:
            pass
    assert len(ledger.syncs) == prefill_syncs + 6
    # Every step but the first was launched (async_eval) before the previous token was read.
    assert ledger.launched > sum(ledger.syncs)
    # Pipelining changes no token: greedy speculation (round by round) gives the same text.
    spec = speculative_generate_step(
        prompt, model, max_tokens=6, num_draft_tokens=3, draft_source="model"
    )
    assert [t for t, _, _ in spec] == want


def test_a_deepseek_v4_bundle_with_its_experts_resident_syncs_once_a_token():
    import bitnest_mlx
    from bitnest_mlx.runtime.demo import demo_bundle_path
    from bitnest_mlx.runtime.speculative import speculative_generate_step

    counts = d.count_dsv4(demo_bundle_path())
    assert counts["kernel"].syncs == counts["pure"].syncs == 0  # a forward reads nothing back
    model, _ = bitnest_mlx.load(demo_bundle_path())
    prompt = mx.array([5, 6, 7], dtype=mx.uint32)
    with dg.gpu_basis() as ledger:
        steps = speculative_generate_step(prompt, model, max_tokens=5, num_draft_tokens=0)
        tokens = [t for t, _, _ in steps]
    assert len(tokens) == 5
    assert len(ledger.syncs) == 1 + 5  # the prompt's cache, then one read a token
    assert ledger.launched > sum(ledger.syncs)  # each step launched before the last token's read
