"""`BITNEST_MLX_KERNELS` is read when a model is loaded, into that model's own switch (its
RunOptions, or a DSV4 model's MXTQ layers), not once for the whole process."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from bitnest_mlx import kernels, loader
from bitnest_mlx.demo import demo_path
from bitnest_mlx.layers.mxtq_linear import MXTQSwitchLinear
from bitnest_mlx.layers.options import RunOptions, at_load, kernels_allowed


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


class _Experts(nn.Module):
    supports_draft = False  # as DeepSeek-V4: no RunOptions, the switch lives in its MXTQ layers

    def __init__(self):
        super().__init__()
        self.experts = [MXTQSwitchLinear(1024, 8, 2, bits=2) for _ in range(2)]


def test_a_model_without_run_options_keeps_the_switch_in_its_mxtq_layers(monkeypatch):
    model = _Experts()
    monkeypatch.setenv("BITNEST_MLX_KERNELS", "0")
    loader._switched(model, RunOptions())
    assert not any(e.use_kernels for e in model.experts) and not loader.uses_kernels(model)
    monkeypatch.setenv("BITNEST_MLX_KERNELS", "1")
    loader._switched(model, RunOptions())
    assert all(e.use_kernels for e in model.experts) and loader.uses_kernels(model)
