"""Manifest and config values the forward depends on are type-checked and cross-checked, so an
edited package is refused with one line instead of building a different model or crashing
(found by seeded corruption of a valid package; see the issue notes)."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from factory import edit_json, make_package

from bitnest_mlx.formats import bitnest
from bitnest_mlx.runtime.loader import load_model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    pkg, _, _ = make_package(tmp_path_factory.mktemp("src") / "pkg", "qwen2", n_layers=1)
    return pkg


@pytest.fixture
def pkg(source, tmp_path):
    return shutil.copytree(source, tmp_path / "pkg")


@pytest.mark.parametrize(
    "file,edit,match",
    [
        ("config.json", lambda c: c.update(rope_scaling=True), "rope_scaling = True"),
        ("config.json", lambda c: c.update(rms_norm_eps=True), "rms_norm_eps = True"),
        ("config.json", lambda c: c.update(rope_theta=-1), "rope_theta = -1"),
        ("config.json", lambda c: c.update(max_position_embeddings="x"), "max_position"),
        ("config.json", lambda c: c.update(rope_theta=64), "expected the two to agree"),
        ("bitnest.json", lambda m: m.update(kv=None), "kv is None, expected an object"),
        ("bitnest.json", lambda m: m.update(rope=[]), "rope is \\[\\], expected an object"),
        ("bitnest.json", lambda m: m["kv"].update(per_channel_offset=None), "per_channel"),
        ("bitnest.json", lambda m: m["kv"].update(r3="yes"), "kv.r3 = 'yes'"),
    ],
)
def test_edited_value_is_refused_in_one_line(pkg, file, edit, match):
    edit_json(pkg, file, edit)
    with pytest.raises(bitnest.PackageError, match=match) as e:
        bitnest.read(pkg)
    assert "\n" not in str(e.value) and str(pkg) in str(e.value)


def test_empty_r4_entry_means_the_defaults_not_no_transform(source, pkg):
    """`{}` for a down_proj in online_hadamard is K = 1, fp32 off (what the validator reads),
    so the model is the original one, not one without R4."""
    entry = "model.layers.0.mlp.down_proj"
    edit_json(pkg, "bitnest.json", lambda m: m["online_hadamard"]["layers"].update({entry: {}}))
    assert bitnest.read(pkg).spec.r4 == [{"K": 1, "fp32": False}]
    tokens = mx.array([[5, 9, 77, 3]])
    want = np.array(load_model(source)(tokens))
    assert np.array_equal(np.array(load_model(pkg)(tokens)), want)
