"""Pipeline parallel DeepSeek-V4 over `mx.distributed`: 2 ranks on 127.0.0.1 (ring backend).

Each rank is a subprocess (tests/pipeline_worker.py, or the generate CLI) started with the ring
backend's environment (MLX_RANK, MLX_HOSTFILE), as `mlx.launch --backend ring -n 2` would. The
tests skip, saying why, only when two ring processes cannot talk on this machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from pipeline_worker import greedy, parameter_bytes

from bitnest_mlx import load
from bitnest_mlx.cli import generate
from bitnest_mlx.layers.pipeline import PipelineStage
from bitnest_mlx.runtime.demo import demo_bundle_path
from bitnest_mlx.runtime.loader import PipelineError

ROOT = Path(__file__).resolve().parents[1]
# A launch takes ~25 s on an idle 2-core box; the bound turns a deadlock into a failure, with room
# for a loaded machine (a starved rank waits on its peer).
TIMEOUT = 240
PROBE = (
    "import mlx.core as mx; g = mx.distributed.init(strict=True, backend='ring'); "
    "assert mx.distributed.all_sum(mx.array(1.0), group=g).item() == g.size() == 2"
)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(argv: list[str], tmp: Path, size: int = 2) -> list[subprocess.CompletedProcess]:
    """Run `python argv` as ranks 0..size-1 of a ring on 127.0.0.1; all finish or all are killed."""
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(size)]))
    env = dict(os.environ, MLX_HOSTFILE=str(hostfile), PYTHONPATH=str(ROOT / "tests"))
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env=dict(env, MLX_RANK=str(r)),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:  # a rank waiting on a dead peer would wait forever
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outs)]


def _check(results: list[subprocess.CompletedProcess]) -> None:
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r} failed:\n{res.stderr[-3000:]}"


@pytest.fixture(scope="module")
def ring(tmp_path_factory) -> None:
    """Skip (with the reason) when two ring-backend processes cannot start here."""
    if not mx.distributed.is_available():
        pytest.skip("mx.distributed is not available in this MLX build")
    try:
        results = launch(["-c", PROBE], tmp_path_factory.mktemp("probe"))
    except subprocess.TimeoutExpired:
        pytest.skip(f"the ring backend did not connect 2 processes on 127.0.0.1 in {TIMEOUT} s")
    for res in results:
        if res.returncode != 0:
            pytest.skip(f"the ring backend cannot start here: {res.stderr.strip()[-500:]}")


@pytest.fixture(scope="module")
def bundle() -> Path:
    return demo_bundle_path()


def test_stage_split_follows_mlx_lm():
    """The last rank runs the first layers; the low ranks take the remainder."""

    class Group:
        def __init__(self, rank: int, size: int):
            self.rank, self.size = (lambda: rank), (lambda: size)

    stages = [PipelineStage.of(Group(r, 4), 6) for r in range(4)]
    assert [(s.start, s.end) for s in stages] == [(4, 6), (2, 4), (1, 2), (0, 1)]
    assert [s.first for s in stages] == [False, False, False, True]
    assert (PipelineStage.of(Group(0, 2), 6, [4, 2]).start, PipelineStage.whole(6).end) == (2, 6)
    with pytest.raises(PipelineError, match="every rank runs at least one layer"):
        PipelineStage.of(Group(0, 2), 6, [6, 0])


def test_formats_without_stages_refuse_a_pipeline(tmp_path):
    """A bitnest package (here: any directory that is not a bundle) is refused before loading."""
    with pytest.raises(PipelineError, match="cannot be split"):
        load(tmp_path, pipeline=object())


def test_two_ranks_match_one_process(ring, bundle, tmp_path):
    """Greedy tokens and last logits equal the single-process run; each rank holds and has
    read about half of the weights."""
    _check(
        launch([str(ROOT / "tests" / "pipeline_worker.py"), str(bundle), str(tmp_path)], tmp_path)
    )
    model, _ = load(bundle)
    tokens, logits = greedy(model)
    whole = parameter_bytes(model)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["layers"] for r in ranks] == [[3, 6], [0, 3]]  # rank 0 runs the last layers
    for r, report in enumerate(ranks):
        assert report["tokens"] == tokens
        assert np.abs(np.load(tmp_path / f"rank{r}.npy") - logits).max() <= 1e-5
        # Embedding (first stage) and norm + head (every stage) are 4% of this tiny model.
        assert report["parameter_bytes"] <= 0.6 * whole
        # What the rank ever read: other stages' tensors were never evaluated.
        assert report["active_bytes_after_load"] <= 0.6 * whole


def test_generate_cli_pipeline_prints_the_single_process_text(ring, bundle, tmp_path, capsys):
    """`--pipeline` under two ranks: rank 0 prints what one process prints (seeded sampling,
    mlx-lm's prefill and decode loop); rank 1 prints nothing."""
    argv = ["--model", str(bundle), "--max-tokens", "12", "--json"]
    results = launch(["-m", "bitnest_mlx.generate", *argv, "--pipeline"], tmp_path)
    _check(results)
    assert generate.main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    piped = json.loads(results[0].stdout)
    assert (piped["text"], piped["tokens"]) == (single["text"], single["tokens"])
    assert results[1].stdout == ""


def test_generate_cli_pipeline_speculates_with_copies_as_one_process(
    ring, bundle, tmp_path, capsys
):
    """n-gram speculation under two ranks: every rank plans the same rounds (fixed costs, the
    same logits), verifies and rolls back its own layers' caches; rank 0 prints what one
    process prints, copies included."""
    argv = ["--model", str(bundle), "--prompt", "abcdabcdabcdab", "--ignore-chat-template"]
    argv += ["--max-tokens", "12", "--mode", "speculative", "--draft-source", "ngram", "--json"]
    results = launch(["-m", "bitnest_mlx.generate", *argv, "--pipeline"], tmp_path)
    _check(results)
    assert generate.main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    piped = json.loads(results[0].stdout)
    assert (piped["text"], piped["tokens"]) == (single["text"], single["tokens"])
    assert piped["stats"]["sources"] == single["stats"]["sources"]
    assert piped["stats"]["sources"]["ngram"]["drafted"] > 0
