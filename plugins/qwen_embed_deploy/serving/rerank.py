"""(query, documents) -> one templated token sequence per pair, as the reranker's own scripts
build it:

  prefix + tokens(middle) + suffix

Qwen3-Reranker (TEXT_PAIRS): middle = "<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>:
{document}". Qwen3-VL-Reranker (VISION_PAIRS, a multimodal checkpoint): "<Instruct>:
{instruction}<Query>:{query's videos and images}{query}\\n<Document>:{document's videos and
images}{document}", each its placeholders (videos.placeholders, tokenizer.image_blocks), and no
thinking block after the assistant's turn begins.

The middle part is tokenized as one text (as the model card does), so BPE merges at the
`<Document>: ` boundary are the model's own. Truncation cuts the end of that part, i.e. the
document's text, never the template, the query or an image: a pair with too little room left
for its document's text is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qwen_embed_client.contract import DEFAULT_TASK, FEWER_FRAMES, RequestError, RerankOptions

from .tokenizer import load_tokenizer, multimodal

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)


@dataclass(frozen=True)
class PairTemplate:
    suffix: str
    default_instruction: str
    after_instruction: str  # between the instruction and "<Query>:"
    after_colon: str  # after "<Query>:" and "<Document>:"

    def middle(
        self, instruction: str, query: str, document: str, query_visuals="", document_visuals=""
    ) -> str:
        return (
            f"<Instruct>: {instruction}{self.after_instruction}<Query>:{self.after_colon}"
            f"{query_visuals}{query}\n<Document>:{self.after_colon}{document_visuals}{document}"
        )


TEXT_PAIRS = PairTemplate(
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    default_instruction=DEFAULT_TASK,
    after_instruction="\n",
    after_colon=" ",
)
VISION_PAIRS = PairTemplate(
    suffix="<|im_end|>\n<|im_start|>assistant\n",
    default_instruction=(
        "Given a search query, retrieve relevant candidates that answer the query."
    ),
    after_instruction="",
    after_colon="",
)


class PairTokenizer:
    def __init__(self, model_dir: str | Path, max_input_tokens: int):
        self._tok = load_tokenizer(model_dir)
        self.max_input_tokens = max_input_tokens
        self.template = VISION_PAIRS if multimodal(model_dir) else TEXT_PAIRS
        self._prefix = self._tok.encode(PREFIX, add_special_tokens=False).ids
        self._suffix = self._tok.encode(self.template.suffix, add_special_tokens=False).ids

    def encode(
        self,
        query: str,
        documents: list[str],
        opts: RerankOptions,
        query_visuals: str = "",
        document_visuals: list[str] | None = None,
        fields: list[str] | None = None,
    ) -> list[list[int]]:
        """One sequence per document; `query_visuals` and `document_visuals` (a multimodal
        checkpoint): each side's videos' and images' placeholder text (videos.placeholders,
        tokenizer.image_blocks), the query's in every pair; `fields`: per document, the input
        a refusal names (DOCUMENT_IMAGES by default)."""
        budget = self.max_input_tokens - len(self._prefix) - len(self._suffix)
        instruction = opts.instruction or self.template.default_instruction
        if opts.max_document_tokens is not None:
            documents = self._first_tokens(documents, opts.max_document_tokens)
        if document_visuals is None:
            document_visuals = [""] * len(documents)
        if (query_visuals or any(document_visuals)) and self.template is not VISION_PAIRS:
            raise RequestError("this reranker reads text only: it takes no images or videos")
        texts = [
            self.template.middle(instruction, query, d, query_visuals, visuals)
            for d, visuals in zip(documents, document_visuals, strict=True)
        ]
        out, heads = [], {}
        # Without the post-processor's tokens, as the model card tokenizes the pair: the
        # template carries its own special tokens.
        for i, enc in enumerate(self._tok.encode_batch_fast(texts, add_special_tokens=False)):
            ids = enc.ids
            if len(ids) > budget:
                # Only pairs over the limit need the length of what truncation must keep.
                visuals = document_visuals[i]
                if visuals not in heads:
                    heads[visuals] = self._head_tokens(instruction, query, query_visuals, visuals)
                field = (fields[i] if fields else "DOCUMENT_IMAGES") if visuals else None
                self._check_head_fits(i, heads[visuals], budget, field)
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

    def _head_tokens(self, instruction: str, query: str, query_visuals: str, visuals: str) -> int:
        # The pair text up to the document's text tokenizes the same with or without the text
        # after it (the pre-tokenizer splits at the space; a visual ends in a special token):
        # the part truncation must keep.
        head = self.template.middle(instruction, query, "", query_visuals, visuals)
        return len(self._tok.encode(head.rstrip(" "), add_special_tokens=False).ids)

    def _check_head_fits(self, index: int, head: int, budget: int, field: str | None) -> None:
        if head >= budget:
            what = f"'{field}[{index}]' with 'QUERY'" if field else "'QUERY'"
            hint = f"; {FEWER_FRAMES}" if field and field.endswith("VIDEOS") else ""
            raise RequestError(
                f"input {what} with the template and instruction takes "
                f"{head + len(self._prefix) + len(self._suffix)} tokens, leaving no room "
                f"for a document within the limit of {self.max_input_tokens}{hint}"
            )
