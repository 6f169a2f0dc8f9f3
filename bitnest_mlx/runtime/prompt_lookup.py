"""Prompt lookup: drafts copied from the context, at no model cost.

The tokens so far (prompt and generated text) are indexed by their n-grams. When the last n
tokens occurred earlier, the tokens that followed that occurrence are the draft. Its draft
distribution is a point mass on those tokens, so every accept rule of `sampling` stays lossless
with it (Saxena, "Prompt lookup decoding", 2023; mlx-lm issue #851).
"""

from __future__ import annotations

from collections.abc import Iterable


class PromptLookup:
    """The continuation of the longest, most recent earlier match of the context's suffix.

    Matches are n-grams of `min_ngram`..`max_ngram` tokens; a longer match wins over a more
    recent shorter one. Each n-gram maps to where its latest continuation starts, updated as
    tokens arrive, so a lookup costs `max_ngram - min_ngram + 1` dict probes.
    """

    def __init__(self, tokens: Iterable[int] = (), min_ngram: int = 2, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of what followed it
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            i = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                self._next[tuple(self.tokens[i - n : i])] = i
            self.tokens.append(int(t))

    def propose(self, limit: int) -> tuple[list[int], int]:
        """(up to `limit` tokens continuing the longest match, its length n); ([], 0) when the
        suffix matches nothing of at least `min_ngram` tokens."""
        size = len(self.tokens)
        for n in range(min(self.max_ngram, size), self.min_ngram - 1, -1):
            start = self._next.get(tuple(self.tokens[size - n :]))
            if start is not None and limit > 0:
                return self.tokens[start : start + limit], n
        return [], 0
