"""A layer's Linears quantized on every core.

The sweeps are Python loops over numpy, one core each, and Linears that share no Hessian are
independent: each group that shares one (q/k/v, o, gate/up, down) is a task, largest input
first, for a worker subprocess or, while every worker is busy, for the converter's own process.
A group's Hessian factor is computed once, where the group runs. Codes do not depend on where a
group runs (`tests/test_convert_workers.py`).
"""

from __future__ import annotations

import os
import pickle
import selectors
import subprocess
import sys
from collections.abc import Mapping

import numpy as np
from threadpoolctl import threadpool_limits

from ..formats.bitnest import Planes
from .methods import Method

# Below this many weights in a layer, a worker's start and the pickling cost more than the
# layer's sweeps (tiny test models run inline).
PARALLEL_MIN_WEIGHTS = 2**20
_BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def quantize_group(
    method: Method, group_size: int, h: np.ndarray | None, weights: list[np.ndarray]
) -> list[tuple[Planes, dict]]:
    """Planes and diagnostics of Linears `weights` ([N, K] each) that read one input (Hessian
    `h`), sharing its factor."""
    factors: dict = {}
    return [method.quantize(w, h, group_size, factors) for w in weights]


class _Worker:
    """A `python -c` subprocess running `_serve`: reads pickled (function, args) tasks on
    stdin, writes pickled ("ok", result) or ("error", traceback) on stdout. A plain subprocess, not
    multiprocessing: nothing of the caller's `__main__` is imported again."""

    def __init__(self, env: Mapping[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **env},
        )

    def send(self, task: tuple) -> None:
        pickle.dump(task, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.flush()

    def receive(self):
        try:
            status, value = pickle.load(self.proc.stdout)
        except EOFError:
            raise RuntimeError(f"quantization worker exited ({self.proc.wait()})") from None
        if status == "error":
            raise RuntimeError(f"in a quantization worker:\n{value}")
        return value

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class LinearPool:
    """`quantize_layer` runs a layer's groups of Linears on `workers` processes, this one and
    `workers` - 1 subprocesses (default: one per core, at most one per group). Each worker's BLAS,
    this process's included while it sweeps beside them, gets its share of the cores: with more
    BLAS threads than cores the sweeps' block products wait on each other. Use as a context
    manager."""

    GROUPS_PER_LAYER = 4  # q/k/v, o, gate/up, down

    def __init__(self, method: Method, group_size: int, workers: int | None = None):
        self.method, self.group_size = method, group_size
        cores = os.cpu_count() or 1
        # Processes quantizing at once, this one included.
        self.workers = min(workers or cores, self.GROUPS_PER_LAYER)
        self._started: list[_Worker] = []

    @property
    def _threads(self) -> int:
        """BLAS threads per quantizing process."""
        return max(1, (os.cpu_count() or 1) // self.workers)

    def _pool(self) -> list[_Worker]:
        """The worker processes (one fewer than `workers`: this process works too), started at
        the first layer that pays for them."""
        if not self._started:
            env = dict.fromkeys(_BLAS_THREADS, str(self._threads))
            self._started = [_Worker(env) for _ in range(self.workers - 1)]
        return self._started

    def __enter__(self) -> LinearPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for worker in self._started:
            worker.close()
        self._started = []

    def quantize_layer(
        self, weights: Mapping[str, np.ndarray], hessians: Mapping[str, np.ndarray | None]
    ) -> dict[str, tuple[Planes, dict]]:
        """{Linear name: (planes, diagnostics)} for `weights` {name: [N, K]}; Linears whose
        Hessians are the same array share a group (and its factor)."""
        groups: dict[int, list[str]] = {}
        for name in weights:
            groups.setdefault(id(hessians.get(name)), []).append(name)
        # Largest input first: a sweep's cost is mostly per column.
        ordered = sorted(
            groups.values(),
            key=lambda names: (weights[names[0]].shape[1], sum(weights[n].size for n in names)),
            reverse=True,
        )
        tasks = []
        for names in ordered:
            h = hessians.get(names[0])
            tasks.append((names, (self.method, self.group_size, h, [weights[n] for n in names])))
        total = sum(w.size for w in weights.values())
        if self.workers == 1 or not self.method.calibrated or total < PARALLEL_MIN_WEIGHTS:
            results = [quantize_group(*args) for _, args in tasks]
        else:
            results = self.map(quantize_group, [args for _, args in tasks])
        return {n: value for (names, _), res in zip(tasks, results) for n, value in zip(names, res)}

    def map(self, function, arguments: list[tuple]) -> list:
        """function(*args) for each of `arguments`, in order, on the workers and in this
        process: a task goes to the first idle worker, and while every worker is busy this
        process takes the next one itself. Results in the same order."""
        results: list = [None] * len(arguments)
        queue = list(enumerate(arguments))
        busy: dict[_Worker, int] = {}
        with selectors.DefaultSelector() as sel, threadpool_limits(self._threads, "blas"):
            for worker in self._pool():
                sel.register(worker.proc.stdout, selectors.EVENT_READ, worker)
            try:
                while queue or busy:
                    for worker in self._pool():
                        if queue and worker not in busy:
                            index, args = queue.pop(0)
                            worker.send((function, args))
                            busy[worker] = index
                    if queue:  # every worker is busy
                        index, args = queue.pop(0)
                        results[index] = function(*args)
                    for key, _ in sel.select(timeout=0 if queue else None):
                        worker = key.data
                        if worker in busy:
                            results[busy.pop(worker)] = worker.receive()
            except BaseException:
                self.close()  # a worker mid-task cannot be reused
                raise
        return results


def _serve() -> None:
    """The worker's loop (see `_Worker`)."""
    import traceback

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stdout carries the replies only
    while True:
        try:
            function, args = pickle.load(stdin)
        except EOFError:
            return
        try:
            reply = ("ok", function(*args))
        except Exception:
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, stdout, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.flush()
