"""A layer's Linears quantized by worker processes give the same planes as in this process:
the groups that share a Hessian (q/k/v, o, gate/up, down) are independent tasks."""

import numpy as np
import pytest

from bitnest_mlx.convert import workers
from bitnest_mlx.convert.methods import Method
from bitnest_mlx.convert.sweep import hessian

SHAPES = {  # a Llama layer at hidden 128, intermediate 256, 2 KV heads of 32
    "self_attn.q_proj": (128, 128),
    "self_attn.k_proj": (64, 128),
    "self_attn.v_proj": (64, 128),
    "self_attn.o_proj": (128, 128),
    "mlp.gate_proj": (256, 128),
    "mlp.up_proj": (256, 128),
    "mlp.down_proj": (128, 256),
}
READS = {  # which input each Linear reads
    "self_attn.k_proj": "self_attn.q_proj",
    "self_attn.v_proj": "self_attn.q_proj",
    "mlp.up_proj": "mlp.gate_proj",
}


def _layer(seed: int = 0):
    rng = np.random.default_rng(seed)
    weights = {n: rng.normal(0, 0.02, s).astype(np.float32) for n, s in SHAPES.items()}
    x = {n: rng.normal(size=(512, s[1])).astype(np.float32) for n, s in SHAPES.items()}
    inputs = {n: hessian(v) for n, v in x.items()}
    return weights, {n: inputs[READS.get(n, n)] for n in SHAPES}


@pytest.mark.parametrize("method", ["joint", "gptq"])
def test_worker_processes_give_the_same_planes_as_this_process(monkeypatch, method):
    weights, hessians = _layer()
    m = Method(method)
    with workers.LinearPool(m, 32, workers=1) as pool:
        serial = pool.quantize_layer(weights, hessians)
    monkeypatch.setattr(workers, "PARALLEL_MIN_WEIGHTS", 0)
    with workers.LinearPool(m, 32, workers=2) as pool:
        parallel = pool.quantize_layer(weights, hessians)
        assert len(pool._started) == 1  # a worker beside this process: tasks left it
    assert list(parallel) != [] and set(parallel) == set(SHAPES)
    for name, (planes, errors) in serial.items():
        other, other_errors = parallel[name]
        for field in ("hi", "lo", "scales"):
            np.testing.assert_array_equal(getattr(planes, field), getattr(other, field))
        # The diagnostics' sums may round differently with the workers' BLAS threads.
        assert errors == pytest.approx(other_errors, rel=1e-6)


def test_a_layer_below_the_size_that_pays_for_a_worker_stays_in_this_process():
    weights, hessians = _layer()
    with workers.LinearPool(Method("joint"), 32, workers=2) as pool:
        out = pool.quantize_layer(weights, hessians)
        assert pool._started == []  # no worker was started
    assert set(out) == set(SHAPES)


def test_an_error_in_a_worker_is_raised_here_with_its_traceback(monkeypatch):
    weights, hessians = _layer()
    hessians["mlp.down_proj"] = np.zeros((3, 3))  # the wrong size for down_proj's input
    monkeypatch.setattr(workers, "PARALLEL_MIN_WEIGHTS", 0)
    with workers.LinearPool(Method("joint"), 32, workers=2) as pool:
        # down_proj (the widest input) is the first task: it goes to the worker
        with pytest.raises(RuntimeError, match="in a quantization worker"):
            pool.quantize_layer(weights, hessians)
        assert pool._started == []  # closed: a worker mid-task cannot be reused


def _blas_threads(info: list[dict]) -> set[int]:
    """The BLAS thread counts in a `threadpool_info()`."""
    return {lib["num_threads"] for lib in info if lib["user_api"] == "blas"}


def test_every_quantizing_process_gets_its_share_of_the_blas_threads(monkeypatch):
    """With more BLAS threads than cores, the sweeps' block products wait on each other."""
    from threadpoolctl import threadpool_info

    monkeypatch.setattr(workers.os, "cpu_count", lambda: 2)
    before = threadpool_info()
    with workers.LinearPool(Method("joint"), 32, workers=2) as pool:
        # Task 0 goes to the worker; while it is busy this process takes task 1 itself.
        in_worker, here = pool.map(threadpool_info, [(), ()])
    assert _blas_threads(in_worker) == _blas_threads(here) == {1}  # 2 cores / 2 processes
    assert threadpool_info() == before  # restored after the layer
