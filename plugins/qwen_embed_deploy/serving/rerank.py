"""(query, documents) -> one templated token sequence per pair, as the reranker's own scripts
build it:

  prefix + tokens(middle) + suffix

Qwen3-Reranker (TEXT_PAIRS): middle = "<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>:
{document}". Qwen3-VL-Reranker (VISION_PAIRS, a multimodal checkpoint): "<Instruct>:
{instruction}<Query>:{query's images}{query}\\n<Document>:{document's images}{document}", each
image its placeholders (tokenizer.image_blocks), and no thinking block after the assistant's
turn begins.

The middle part is tokenized as one text (as the model card does), so BPE merges at the
`<Document>: ` boundary are the model's own. Truncation cuts the end of that part, i.e. the
document's text, never the template, the query or an image: a pair with too little room left
for its document's text is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qwen_embed_client.contract import DEFAULT_TASK, RequestError, RerankOptions

from .tokenizer import image_blocks, load_tokenizer, multimodal

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
        self, instruction: str, query: str, document: str, query_images="", document_images=""
    ) -> str:
        return (
            f"<Instruct>: {instruction}{self.after_instruction}<Query>:{self.after_colon}"
            f"{query_images}{query}\n<Document>:{self.after_colon}{document_images}{document}"
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
        query_images: list[int] = (),
        document_images: list[list[int]] | None = None,
    ) -> list[list[int]]:
        """One sequence per document; `query_images` and `document_images` (a multimodal
        checkpoint): each image's placeholder count, the query's in every pair."""
        budget = self.max_input_tokens - len(self._prefix) - len(self._suffix)
        instruction = opts.instruction or self.template.default_instruction
        if opts.max_document_tokens is not None:
            documents = self._first_tokens(documents, opts.max_document_tokens)
        if document_images is None:
            document_images = [[]] * len(documents)
        if (query_images or any(document_images)) and self.template is not VISION_PAIRS:
            name = "QUERY_IMAGES" if query_images else "DOCUMENT_IMAGES"
            raise RequestError(f"input '{name}' holds images, and this reranker reads text only")
        blocks = image_blocks(query_images)
        texts = [
            self.template.middle(instruction, query, d, blocks, image_blocks(images))
            for d, images in zip(documents, document_images, strict=True)
        ]
        out, heads = [], {}
        # Without the post-processor's tokens, as the model card tokenizes the pair: the
        # template carries its own special tokens.
        for i, enc in enumerate(self._tok.encode_batch(texts, add_special_tokens=False)):
            ids = enc.ids
            if len(ids) > budget:
                # Only pairs over the limit need the length of what truncation must keep.
                images = tuple(document_images[i])
                if images not in heads:
                    heads[images] = self._head_tokens(instruction, query, blocks, images)
                self._check_head_fits(i, heads[images], budget, images)
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

    def _head_tokens(self, instruction: str, query: str, blocks: str, images: tuple) -> int:
        # The pair text up to the document's text tokenizes the same with or without the text
        # after it (the pre-tokenizer splits at the space; an image ends in a special token):
        # the part truncation must keep.
        head = self.template.middle(instruction, query, "", blocks, image_blocks(images))
        return len(self._tok.encode(head.rstrip(" "), add_special_tokens=False).ids)

    def _check_head_fits(self, index: int, head: int, budget: int, images: tuple) -> None:
        if head >= budget:
            what = f"'DOCUMENT_IMAGES[{index}]' with 'QUERY'" if images else "'QUERY'"
            raise RequestError(
                f"input {what} with the template and instruction takes "
                f"{head + len(self._prefix) + len(self._suffix)} tokens, leaving no room "
                f"for a document within the limit of {self.max_input_tokens}"
            )
