"""Context lookup: continue the newest tokens the way the context (prompt + everything generated) continued them.

The n-gram index is kept incrementally: each round registers only the tokens committed since the last round, so a
query costs ``O(max_ngram)`` dictionary lookups whatever the context length (transformers' prompt lookup rescans the
whole context every round). The latest earlier occurrence wins, which follows the loops small models fall into.

Example::

    lookup = ContextLookup(max_ngram=4)
    lookup.extend([5, 6, 7, 8, 5, 6])
    lookup.propose(num_tokens=3, min_ngram=2)   # (2, [7, 8, 5]): "5 6" was followed by "7 8 5 ..."
"""

from __future__ import annotations

__all__ = ["ContextLookup"]


class ContextLookup:
    """An incrementally kept n-gram index over one sequence of token ids (n = 1 .. ``max_ngram``)."""

    def __init__(self, max_ngram: int = 4):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be at least 1, got {max_ngram}.")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> position of its last token, latest occurrence
        self._registered = 0  # n-grams ending before this position are in the index

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens; index every n-gram that ends before the newest token (the query's own suffix)."""
        self.tokens.extend(int(t) for t in tokens)
        for end in range(self._registered, len(self.tokens) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self._index[tuple(self.tokens[end - n + 1 : end + 1])] = end
        self._registered = max(self._registered, len(self.tokens) - 1)

    def propose(self, num_tokens: int, min_ngram: int = 1) -> tuple[int, list[int]]:
        """``(match length, continuation)`` for the longest suffix n-gram (``>= min_ngram``) seen earlier; ``(0, [])``.

        The continuation is what followed the match, up to ``num_tokens`` tokens; when it runs into the present (a
        loop shorter than ``num_tokens``), it keeps repeating the loop.
        """
        matched, start = self.match(min_ngram)
        return (matched, self.continuation(start, num_tokens)) if matched else (0, [])

    def match(self, min_ngram: int = 1) -> tuple[int, int]:
        """``(match length, start)``: the longest suffix n-gram (``>= min_ngram``) seen earlier, and the position of
        the token that followed its latest occurrence; ``(0, -1)`` when none matches. The continuation is the tokens
        from ``start`` to the present, repeated (a caller holding the sequence as a tensor slices it from there)."""
        length = len(self.tokens)
        for n in range(min(self.max_ngram, length), max(min_ngram, 1) - 1, -1):
            end = self._index.get(tuple(self.tokens[length - n :]))
            if end is not None:
                return n, end + 1
        return 0, -1

    def continuation(self, start: int, num_tokens: int) -> list[int]:
        """``num_tokens`` tokens from ``start`` on, the span ``start .. present`` repeated where it runs out."""
        span = self.tokens[start:]
        return [span[i % len(span)] for i in range(num_tokens)]
