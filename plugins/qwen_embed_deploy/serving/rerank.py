"""(query, documents) -> one templated token sequence per pair, as Qwen3-Reranker builds it.

  prefix + tokens("<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}") + suffix

The middle part is tokenized as one text (as the model card does), so BPE merges at the
`<Document>: ` boundary are the model's own. Truncation cuts the end of that part, i.e. the
document, never the template or the query: a query too long to leave room is refused.
"""

from __future__ import annotations

from pathlib import Path

from qwen_embed_client.contract import RequestError, RerankOptions

from .tokenizer import load_tokenizer

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def pair_text(query: str, document: str, instruction: str) -> str:
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


class PairTokenizer:
    def __init__(self, model_dir: str | Path, max_input_tokens: int):
        self._tok = load_tokenizer(model_dir)
        self.max_input_tokens = max_input_tokens
        self._prefix = self._tok.encode(PREFIX, add_special_tokens=False).ids
        self._suffix = self._tok.encode(SUFFIX, add_special_tokens=False).ids

    def encode(self, query: str, documents: list[str], opts: RerankOptions) -> list[list[int]]:
        budget = self.max_input_tokens - len(self._prefix) - len(self._suffix)
        if opts.max_document_tokens is not None:
            documents = self._first_tokens(documents, opts.max_document_tokens)
        texts = [pair_text(query, d, opts.instruction) for d in documents]
        out, query_checked = [], False
        # Without the post-processor's tokens, as the model card tokenizes the pair: the
        # template carries its own special tokens.
        for i, enc in enumerate(self._tok.encode_batch(texts, add_special_tokens=False)):
            ids = enc.ids
            if len(ids) > budget:
                if not query_checked:  # only pairs over the limit need the query's length
                    self._check_query_fits(query, opts.instruction, budget)
                    query_checked = True
                if not opts.truncate:
                    raise RequestError(
                        f"input 'DOCUMENTS[{i}]' makes a pair of "
                        f"{len(ids) + len(self._prefix) + len(self._suffix)} tokens, more than "
                        f"the limit of {self.max_input_tokens} (send truncate=true to cut it)"
                    )
                ids = ids[:budget]
            out.append(self._prefix + ids + self._suffix)
        return out

    def _first_tokens(self, documents: list[str], n: int) -> list[str]:
        """Each document up to the end of its n-th token (tokenized alone)."""
        encoded = self._tok.encode_batch(documents, add_special_tokens=False)
        return [
            doc[: enc.offsets[n - 1][1]] if len(enc.ids) > n else doc
            for doc, enc in zip(documents, encoded, strict=True)
        ]

    def _check_query_fits(self, query: str, instruction: str, budget: int) -> None:
        # The pair text up to "<Document>:" tokenizes the same with or without a document
        # after it (the pre-tokenizer splits at the space): the part truncation must keep.
        head = self._tok.encode(
            pair_text(query, "", instruction).rstrip(" "), add_special_tokens=False
        ).ids
        if len(head) >= budget:
            raise RequestError(
                f"input 'QUERY' with the template and instruction takes "
                f"{len(head) + len(self._prefix) + len(self._suffix)} tokens, leaving no room "
                f"for a document within the limit of {self.max_input_tokens}"
            )
