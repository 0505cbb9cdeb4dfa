"""A byte-level BPE trainer whose output is a tiktoken rank table.

Training works on unique pre-tokenized words with their counts (BPE never merges across words), and
keeps the count of every adjacent pair up to date incrementally: a merge only revisits the words that
contain the merged pair, and a lazy max-heap finds the next most frequent pair.
"""

from __future__ import annotations

import base64
import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable

import regex

from titanrush.data.tokenizer import LLAMA3_PATTERN


def count_words(texts: Iterable[str], pattern: str = LLAMA3_PATTERN) -> Counter[bytes]:
    """Count the UTF-8 bytes of each pre-tokenized word over `texts`."""
    split = regex.compile(pattern).findall
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(split(text))
    out: Counter[bytes] = Counter()
    for word, n in counts.items():
        out[word.encode("utf-8", "surrogatepass")] += n
    return out


def train_bpe(word_counts: dict[bytes, int], n_ranks: int) -> dict[bytes, int]:
    """Learn merges until the table has `n_ranks` tokens (256 single bytes + n_ranks - 256 merges).

    Ties between equally frequent pairs go to the pair of lower token ids, so the result is
    deterministic. A merge whose bytes already exist as a token (reached through another pair) is
    applied to the words but takes no new rank.

    Args:
        word_counts: UTF-8 bytes of each unique word -> number of occurrences.
        n_ranks: size of the rank table to build (>= 256).

    Returns:
        Token bytes -> rank, ranks 0..n_ranks-1, single bytes first (rank = byte value). Fewer
        ranks come back if the words run out of pairs first.
    """
    assert n_ranks >= 256
    token_bytes = [bytes([i]) for i in range(256)]
    ranks = {b: i for i, b in enumerate(token_bytes)}
    words = [list(w) for w in word_counts]
    counts = list(word_counts.values())

    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_count[pair] += counts[wi]
            pair_words[pair].add(wi)
    heap = [(-c, pair) for pair, c in pair_count.items()]
    heapq.heapify(heap)

    while len(ranks) < n_ranks and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or neg == 0:
            continue  # a stale heap entry: the count changed since it was pushed
        merged = token_bytes[pair[0]] + token_bytes[pair[1]]
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = ranks[merged] = len(token_bytes)
            token_bytes.append(merged)
        changed: set[tuple[int, int]] = set()
        for wi in pair_words.pop(pair):
            word, c = words[wi], counts[wi]
            new_word = _merge(word, pair, new_id)
            if len(new_word) == len(word):
                continue  # the word lost this pair to an earlier merge
            for p in zip(word, word[1:]):
                pair_count[p] -= c
                changed.add(p)
            for p in zip(new_word, new_word[1:]):
                pair_count[p] += c
                pair_words[p].add(wi)
                changed.add(p)
            words[wi] = new_word
        pair_count.pop(pair, None)
        changed.discard(pair)
        for p in changed:
            c = pair_count[p]
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_count.pop(p, None)
    return ranks


def rank_file_text(ranks: dict[bytes, int]) -> str:
    """A rank table in tiktoken's rank-file format: `base64(token bytes) rank` per line, by rank."""
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    return "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in ordered)


def _merge(word: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    a, b = pair
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out
