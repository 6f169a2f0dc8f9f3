"""The real-size conversion path at small dimensions (what examples/convert_real_size.sh runs at
Llama-3.2-3B's): a transformers-5 checkpoint with llama3 RoPE, streamed through the converter's
CLI into a sharded package that records its resources and its source's name, and runs."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import bitnest_mlx
from bitnest_mlx.cli.convert import main
from bitnest_mlx.convert.checkpoint import make_checkpoint
from bitnest_mlx.formats.bitnest import read


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("stream")
    ckpt = make_checkpoint(root / "llama3b-tiny", tiny=True, progress=False)
    out = root / "pkg"
    assert (
        main(
            [
                "--hf-path",
                str(ckpt),
                "--out",
                str(out),
                "--calib-tokens",
                "1024",
                "--calib-seq-len",
                "64",
            ]
        )
        == 0
    )
    return out, json.loads((out / "bitnest.json").read_text())


def test_manifest_records_each_stage_and_the_source_name_not_its_path(converted):
    _, manifest = converted
    resources = manifest["conversion"]["resources"]
    assert set(resources["stages"]) == {"read", "calibrate", "quantize", "write"}
    for stage in resources["stages"].values():
        assert stage["seconds"] >= 0 and stage["peak_rss_gb"] > 0
    assert resources["peak_rss_gb"] >= max(s["peak_rss_gb"] for s in resources["stages"].values())
    assert manifest["source_model"] == manifest["conversion"]["source"] == "llama3b-tiny"
    assert "/" not in json.dumps(manifest["conversion"]["source"])


def test_llama3_rope_parameters_reach_the_package(converted):
    out, manifest = converted
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert manifest["rope"]["scaling"] == config["rope_scaling"]


def test_streamed_package_reads_and_its_modes_differ(converted):
    out, _ = converted
    read(out)  # every validation rule
    model, _ = bitnest_mlx.load(out, dtype=mx.float32)
    x = mx.array([[1, 2, 3, 4]])
    draft, target = (np.array(model(x, mode=m)) for m in ("draft", "target"))
    assert np.isfinite(target).all() and not np.array_equal(draft, target)


def test_writer_shards_by_size(tmp_path):
    """A shard limit below the package's size gives several shards and an index that lists
    every tensor once; the package reads the same as a single file."""
    from bitnest_mlx.convert.pipeline import build
    from bitnest_mlx.convert.sources import load_hf

    ckpt = make_checkpoint(tmp_path / "ckpt", tiny=True, progress=False)
    single, sharded = tmp_path / "one", tmp_path / "many"
    with load_hf(ckpt) as source:
        build(single, source)
        build(sharded, source, shard_bytes=2**18)
    assert (single / "model.safetensors").is_file()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = read(single).tensors, read(sharded).tensors
    assert set(a) == set(b)
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file(), reason="Linux /proc only")
def test_stage_memory_counts_a_workers_own_pages_once_and_not_its_shared_ones():
    import subprocess
    import sys

    from bitnest_mlx.convert.stages import _statm_rss, current_rss

    mb = 2**20
    child = subprocess.Popen(
        [sys.executable, "-c", "x = b'x' * (200 * 2**20); print('ready', flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ready\n"  # its 200 MB are resident now
        alone = _statm_rss("self")
        counted = current_rss() - alone
        assert 200 * mb <= counted < _statm_rss(str(child.pid))  # its libraries: not again
    finally:
        child.kill()
        child.wait()
