"""Writing a package's reduced draft vocabulary (docs/bitnest-package.md §2.9, docs/convert.md).

Which ids to keep is measured on the written package through the runtime: that is
`measurement.draft_vocab_score.score_draft_vocabulary` (load the package, rank its tokens,
choose K by the step-time model), the converter's one import from above its rank
(tests/test_architecture.py). This module stores the choice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..formats.bitnest.draft_vocab import add_draft_vocab


def build_draft_vocab(
    package: str | Path, calibration: np.ndarray, size: int | str = "auto"
) -> dict:
    """Choose a written package's draft vocabulary (`score_draft_vocabulary`: K = `size` or,
    for "auto", the step-time model's; "full" or a K of at least the vocabulary keeps all) and store
    it (`add_draft_vocab`). `calibration` is [n_seq, seq_len]. Returns the record kept in the
    manifest's `draft.ranking` with the vocabulary size (the same without a draft block)."""
    from ..measurement.draft_vocab_score import score_draft_vocabulary

    choice = score_draft_vocabulary(package, calibration, size)
    if choice.ids is None:
        return {"vocab_size": choice.vocab_size, "kept": "full", **choice.record}
    add_draft_vocab(package, choice.ids, choice.record)
    return {"vocab_size": choice.vocab_size, **choice.record}
