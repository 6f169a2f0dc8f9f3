import os
import tempfile

import mlx.core as mx
import pytest

# Tests never touch the user's cache: the demo package is built into a per-run directory.
os.environ.setdefault("BITNEST_MLX_CACHE", tempfile.mkdtemp(prefix="bitnest-test-cache-"))


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)
