"""`BITNEST_MLX_KERNELS` is read when a model is loaded, into that model's own switch (its
RunOptions, for both families), not once for the whole process."""

from __future__ import annotations

import mlx.core as mx

from bitnest_mlx import kernels
from bitnest_mlx.layers.options import RunOptions, at_load, kernels_allowed
from bitnest_mlx.runtime import loader
from bitnest_mlx.runtime.demo import demo_bundle_path, demo_path


def test_only_zero_turns_the_kernels_off():
    assert kernels_allowed({}) and kernels_allowed({"BITNEST_MLX_KERNELS": "1"})
    assert not kernels_allowed({"BITNEST_MLX_KERNELS": "0"})
    off = at_load(RunOptions(mode="draft", draft_kv=8), {"BITNEST_MLX_KERNELS": "0"})
    assert off == RunOptions(mode="draft", draft_kv=8, use_kernels=False)


def test_each_load_reads_the_switch_again(monkeypatch):
    monkeypatch.setenv("BITNEST_MLX_KERNELS", "0")
    off, _ = loader.load(demo_path(), mode="draft")
    monkeypatch.delenv("BITNEST_MLX_KERNELS")
    on, _ = loader.load(demo_path())
    assert off.options == RunOptions(mode="draft", use_kernels=False)
    assert on.options.use_kernels and not off.options.use_kernels
    assert not loader.uses_kernels(off) and loader.uses_kernels(on)


def test_a_model_loaded_with_kernels_off_never_asks_for_one_even_on_metal(monkeypatch):
    monkeypatch.setenv("BITNEST_MLX_KERNELS", "0")
    model = loader.load_model(demo_path())
    asked = []
    monkeypatch.setattr(kernels.dispatch, "_metal", lambda: True)
    monkeypatch.setattr(kernels, "use", lambda name, self_test: asked.append(name) or False)
    mx.eval(model(mx.array([[1, 2, 3]]), model.make_cache()))
    assert asked == []


def test_a_deepseek_v4_model_keeps_the_switch_in_its_run_options_too(monkeypatch):
    monkeypatch.setenv("BITNEST_MLX_KERNELS", "0")
    off = loader.load_model(demo_bundle_path())
    assert not off.options.use_kernels and not loader.uses_kernels(off)
    monkeypatch.setenv("BITNEST_MLX_KERNELS", "1")
    on = loader.load_model(demo_bundle_path())
    assert on.options.use_kernels and loader.uses_kernels(on)


def test_the_run_options_reach_the_mxtq_experts(monkeypatch):
    """A DSV4 model loaded with kernels off never asks for one (its MXTQ experts get the call's
    options, not a switch of their own); loaded with them on, its decode asks."""
    asked = []
    monkeypatch.setattr(kernels.dispatch, "_metal", lambda: True)
    monkeypatch.setattr(kernels, "use", lambda name, self_test: asked.append(name) or False)
    for env, asks in (("0", False), ("1", True)):
        monkeypatch.setenv("BITNEST_MLX_KERNELS", env)
        model = loader.load_model(demo_bundle_path())
        cache = model.make_cache()
        asked.clear()
        mx.eval(model(mx.array([[1, 2, 3]]), cache), model(mx.array([[4]]), cache))
        assert bool(asked) == asks
