"""(query, documents) -> a listwise reranker's sequences (jina-reranker-v3), as its own `rerank`
builds them: the query cut to its first 512 tokens and each document to 2,048 (tokenized alone,
the cut text decoded back), the documents in blocks of up to 125 while their tokens leave more
than 2,048 of the tokenizer's length after twice the query's, each block one prompt:

  system prompt + "I will provide you with {k} passages, ... to query: {query}\\n"
  + ["<instruct>\\n{instruction}\\n</instruct>\\n"]
  + '<passage id="{i}">\\n{document}<|embed_token|>\\n</passage>' per document, joined by "\\n"
  + "\\n<query>\\n{query}<|rerank_token|>\\n</query>" + the assistant's turn

tokenized as one text, the marker strings taken out of every text first. The engine reads the
hidden states at the markers (heads.ListwiseHead). One row per document leaves here: the first
document of each block carries its block's sequence, the others none (the encoder scores a
query's blocks together).

Where the deployment's token limit is below the tokenizer's length, blocks are sized by the
limit; a block whose prompt still exceeds it is halved until it fits.
"""

from __future__ import annotations

from pathlib import Path

from qwen_embed.config import LISTWISE_MARKERS
from qwen_embed.loader import read_json
from qwen_embed_client.contract import RequestError, RerankOptions

from .tokenizer import first_tokens, load_tokenizer

QUERY_TOKENS = 512
DOCUMENT_TOKENS = 2048
BLOCK_DOCUMENTS = 125
PREFIX = (
    "<|im_start|>system\nYou are a search relevance expert who can determine a ranking of the "
    "passages based on how relevant they are to the query. If the query is a question, how "
    "relevant a passage is depends on how well it answers the question. If not, try to analyze "
    "the intent of the query and assess how well each passage satisfies the intent. If an "
    "instruction is provided, you should follow the instruction when determining the ranking."
    "<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DOCUMENT_MARKER, QUERY_MARKER = LISTWISE_MARKERS


def prompt(query: str, documents: list[str], instruction: str | None) -> str:
    query, documents = _clean(query), [_clean(d) for d in documents]
    text = (
        f"I will provide you with {len(documents)} passages, each indicated by a numerical "
        f"identifier. Rank the passages based on their relevance to query: {query}\n"
    )
    if instruction:
        text += f"<instruct>\n{_clean(instruction)}\n</instruct>\n"
    passages = [
        f'<passage id="{i}">\n{d}{DOCUMENT_MARKER}\n</passage>' for i, d in enumerate(documents)
    ]
    text += "\n".join(passages) + f"\n<query>\n{query}{QUERY_MARKER}\n</query>"
    return PREFIX + text + SUFFIX


def _clean(text: str) -> str:
    for marker in LISTWISE_MARKERS:
        text = text.replace(marker, "")
    return text


class BlockTokenizer:
    reads_images = reads_video = document_first = False  # it reads text only

    def __init__(self, model_dir: str | Path, max_input_tokens: int):
        self._tok = load_tokenizer(model_dir)
        self.max_input_tokens = max_input_tokens
        config = read_json(Path(model_dir) / "tokenizer_config.json", {})
        self.length = min(int(config.get("model_max_length") or max_input_tokens), max_input_tokens)

    def encode(self, query: str, documents: list[str], opts: RerankOptions) -> list[list[int]]:
        """Per document a row: its block's token ids on each block's first document, [] on
        the others."""
        if opts.max_document_tokens is not None:
            documents = first_tokens(self._tok, documents, opts.max_document_tokens)
        ((query, query_tokens),) = self._cut([query], QUERY_TOKENS, opts.truncate, "QUERY")
        cut = self._cut(documents, DOCUMENT_TOKENS, opts.truncate, "DOCUMENTS")
        rows: list[list[int]] = []
        for block in self._blocks([n for _, n in cut], query_tokens):
            for ids, size in self._fitted(query, [cut[i][0] for i in block], opts.instruction):
                rows += [ids] + [[]] * (size - 1)
        return rows

    def _cut(
        self, texts: list[str], limit: int, truncate: bool, field: str
    ) -> list[tuple[str, int]]:
        """Per text (it, or its first `limit` tokens decoded back; its token count, at most
        `limit`) as its `rerank` cuts it; `field` (an input) names a text refused without
        `truncate`."""
        out = []
        for i, enc in enumerate(self._tok.encode_batch(texts)):
            if len(enc.ids) < limit:
                out.append((texts[i], len(enc.ids)))
                continue
            if len(enc.ids) > limit and not truncate:
                raise RequestError(
                    f"input '{field}[{i}]' has {len(enc.ids)} tokens, more than this reranker "
                    f"reads ({limit}; send truncate=true to cut it)"
                )
            out.append((self._tok.decode(enc.ids[:limit], skip_special_tokens=False), limit))
        return out

    def _blocks(self, lengths: list[int], query_tokens: int) -> list[list[int]]:
        """Documents' indices per block: a block ends at BLOCK_DOCUMENTS documents or when
        what is left of the length after twice the query is DOCUMENT_TOKENS or less."""
        blocks, block, room = [], [], self.length - 2 * query_tokens
        for i, n in enumerate(lengths):
            block.append(i)
            room -= n
            if len(block) >= BLOCK_DOCUMENTS or room <= DOCUMENT_TOKENS:
                blocks.append(block)
                block, room = [], self.length - 2 * query_tokens
        return blocks + ([block] if block else [])

    def _fitted(self, query: str, documents: list[str], instruction: str | None):
        """(token ids, documents) of the block's prompt, halved until each fits the limit."""
        ids = self._tok.encode(prompt(query, documents, instruction)).ids
        if len(ids) <= self.max_input_tokens:
            return [(ids, len(documents))]
        if len(documents) == 1:
            raise RequestError(
                f"input 'QUERY' with one document and the template takes {len(ids)} tokens, "
                f"more than the limit of {self.max_input_tokens}"
            )
        half = len(documents) // 2
        return self._fitted(query, documents[:half], instruction) + self._fitted(
            query, documents[half:], instruction
        )
