import os
import tempfile

# One pytest-xdist worker per core (the README's test command): a worker whose torch or
# OpenBLAS also starts a thread per core oversubscribes the machine, and their spinning threads
# cost more than they give (here: a third of the suite's CPU time). Set before either loads;
# the children the tests start inherit it. An explicit setting wins.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")

import mlx.core as mx
import pytest
import tools

# Tests never touch the user's cache: the demo package is built into a per-run directory.
os.environ.setdefault("BITNEST_MLX_CACHE", tempfile.mkdtemp(prefix="bitnest-test-cache-"))


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under BITNEST_REQUIRE_TOOLS (CI), a skip for a missing system tool is a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and tools.required() and tools.MISSING in str(report.longrepr):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"{reason}; {tools.REQUIRE_ENV} is set, so this is a failure"


@pytest.fixture
def stored_kernels(monkeypatch):
    """The reports' kernel counts from the runtime's stored table instead of the counter: a
    count takes tens of seconds a model here, and tests/test_dispatches.py checks the table
    against the counter (files whose reports are not about the counts use this)."""
    from bitnest_mlx.measurement import step_costs
    from bitnest_mlx.runtime.step_kernels import STORED

    monkeypatch.setattr(step_costs, "counted", lambda args: STORED)
