"""Real-model checks; skipped unless examples/real_model.py has fetched the GGUF into the cache."""

import os
from pathlib import Path

import pytest

CACHE = Path(
    os.environ.get("BITNEST_REAL_MODEL_CACHE", Path.home() / ".cache/bitnest_mlx/realmodel")
)
GGUF = CACHE / "qwen2.5-coder-0.5b-instruct.gguf"

pytestmark = pytest.mark.skipif(
    not GGUF.is_file(), reason=f"real model not fetched ({GGUF}); run examples/real_model.py"
)


def test_gguf_tokenizer_reproduces_qwen_token_ids(tmp_path):
    gguf = pytest.importorskip("gguf")
    from mlx_lm.tokenizer_utils import load

    from bitnest_mlx.convert.sources import _write_gguf_tokenizer

    _write_gguf_tokenizer(gguf.GGUFReader(str(GGUF)), GGUF, tmp_path)
    tok = load(tmp_path)
    # Ids of the real Qwen2.5 tokenizer (docs/real-model-reference.md §3).
    assert tok.encode("def fibonacci(n):\n    return n") == [750, 75698, 1445, 982, 262, 470, 308]
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
