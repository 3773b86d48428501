"""The seeded text mix every benchmark, perf_analyzer input and Locust user draws from.

Texts are made of common English words that are one Qwen token each (with their leading space),
so a text of N words is N tokens, plus the <|endoftext|> the Qwen3-Embedding tokenizer appends.
The default mix is the one the peer comparison uses: 80% short texts of 16-64 words and 20% long
ones of 256-1024 words (lengths uniform within each band), about 190 tokens per text on average.
"""

from __future__ import annotations

import numpy as np

from qwen_embed_client.contract import DEFAULT_TASK

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has more when will "
    "would who so no about if out up into them some time could than other what new only "
    "also any these may then two first like over such our man me even most made after "
    "way many must well should"
).split()
# Qwen3-Embedding's query instruction (its recipe's default task), which queries begin with
PROMPT = f"Instruct: {DEFAULT_TASK}\nQuery:"
SHORT_WORDS = (16, 64)
LONG_WORDS = (256, 1024)
LONG_FRACTION = 0.2


def make_texts(
    n: int,
    seed: int = 0,
    short: tuple[int, int] = SHORT_WORDS,
    long: tuple[int, int] = LONG_WORDS,
    long_fraction: float = LONG_FRACTION,
) -> list[str]:
    rng = np.random.default_rng(seed)
    is_long = rng.random(n) < long_fraction
    lengths = np.where(
        is_long, rng.integers(long[0], long[1] + 1, n), rng.integers(short[0], short[1] + 1, n)
    )
    return [" ".join(rng.choice(WORDS, size=int(k))) for k in lengths]


def alternate(
    encoder, ids: list[list[int]], variants: dict, repeats: int = 1, rounds: int = 2
) -> dict:
    """A/B (or more) inside one process on one encoder: `variants` maps a name to a function
    that switches the encoder to it; the variants take turns for `rounds` rounds of `repeats`
    embeds each, so the machine's drift falls on all of them. Returns per variant the best
    tokens/s and the vectors of its last run."""
    import time

    tokens = sum(map(len, ids))
    rates, vectors = {}, {}
    for _ in range(rounds):
        for name, switch in variants.items():
            switch()
            encoder.embed(ids[:2])
            began = time.perf_counter()
            for _ in range(repeats):
                vectors[name] = encoder.embed(ids)
            rate = repeats * tokens / (time.perf_counter() - began)
            rates[name] = max(rates.get(name, 0.0), rate)
    return {name: {"tok_s": rates[name], "vectors": vectors[name]} for name in variants}


def alternate_forwards(
    encoder, chunks: list[list[list[int]]], variants: dict, rounds: int = 3
) -> dict:
    """Like `alternate`, one embed per chunk (so one forward each when a chunk fits the token
    budget): per variant the best seconds per forward over `rounds` turns. The first turn
    also pays what is new to each variant (plans, compiles)."""
    import time

    best = {}
    for _ in range(rounds):
        for name, switch in variants.items():
            switch()
            began = time.perf_counter()
            for chunk in chunks:
                encoder.embed(chunk)
            seconds = (time.perf_counter() - began) / len(chunks)
            best[name] = min(best.get(name, seconds), seconds)
    return best


def make_queries(n: int, seed: int = 1) -> list[str]:
    """Short queries of 4-30 words after the query instruction."""
    rng = np.random.default_rng(seed)
    return [PROMPT + " ".join(rng.choice(WORDS, size=int(k))) for k in rng.integers(4, 31, n)]
