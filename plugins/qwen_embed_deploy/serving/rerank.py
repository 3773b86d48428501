"""(query, documents) -> one templated token sequence per pair, as the reranker's own scripts
build it:

  prefix + tokens(piece) + tokens(piece) ... + suffix

A reranker in sentence-transformers' CrossEncoder form has its own chat template (chat_pairs.py)
and jina-reranker-v3 its blocks (listwise.py): `pair_tokenizer` picks. Otherwise which reranker
a checkpoint is follows from its family (`pair_template`; the engine reads the same family's
answer tokens, heads.ANSWER_TOKENS):
- Qwen3-Reranker (TEXT_PAIRS): one piece, "<Instruct>: {instruction}\\n<Query>: {query}\\n
  <Document>: {document}", tokenized as one text (as its model card does), so BPE merges at the
  `<Document>: ` boundary are the model's own.
- Qwen3-VL-Reranker (VISION_PAIRS, a multimodal checkpoint): "<Instruct>: {instruction}<Query>:
  {query's videos and images}{query}\\n<Document>:{document's videos and images}{document}",
  each its placeholders (videos.placeholders, tokenizer.image_blocks), and no thinking block
  after the assistant's turn begins.
- mxbai-rerank-v2 (MXBAI_PAIRS, the Qwen2 reranker): "query: {query}" (after "instruction:
  {instruction}\\n" when one is given), "\\n" and "document: {document}", each tokenized
  apart as its library does.
- jina-reranker-m0 (JINA_M0_PAIRS, `JinaVLForRanking`): its formatting_prompts_func,
  "**Document**:\\n{document}\\n**Query**:\\n{query}" (after "{instruction}\\n", its
  prefix_str, when one is given), an image's placeholders standing for its side's text (one
  image, alone), then its score token (id 100).

Truncation cuts the document's text, never the template, the query or an image: the end of
the last piece, or where the document comes first (jina-reranker-m0) its text cut to the
tokens that fit, as its script cuts a long document; a pair with too little room left for its
document's text is refused, and so is a query or document that already holds its template's
head or tail (a client's own formatting, which would be wrapped twice).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from qwen_embed.config import ModelConfig
from qwen_embed_client.contract import DEFAULT_TASK, FEWER_FRAMES, RequestError, RerankOptions

from .chat_pairs import ChatPairTokenizer
from .listwise import BlockTokenizer
from .tokenizer import first_tokens, load_tokenizer

QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)


@dataclass(frozen=True)
class PairTemplate:
    prefix: str
    suffix: str
    default_instruction: str | None
    _: KW_ONLY
    suffix_ids: tuple[int, ...] = ()  # token ids after the suffix (jina-reranker-m0's)
    reads_images: bool = False
    reads_video: bool = False
    document_first: bool = False  # the document's text before the query (not at the end)

    def pieces(
        self,
        instruction: str | None,
        query: str,
        document: str,
        query_visuals="",
        document_visuals="",
    ) -> tuple[str, ...]:
        """The texts between prefix and suffix, each tokenized apart; the document's text ends
        the last."""
        raise NotImplementedError

    def refusal(self, text: str, visuals: str) -> str | None:
        """Why a side (its text and its visuals' placeholders) cannot be read; None: it can.
        A side that already holds the template's head or tail (a client formatting its pairs
        itself, as vLLM's examples do for Qwen3-Reranker served without a template) would be
        wrapped twice and scored as nonsense."""
        if any(part and part in text for part in (self.prefix.strip(), self.suffix.strip())):
            return (
                "holds this reranker's prompt template, which the server applies itself: send "
                "the bare query and documents (a task in 'instruction')"
            )
        return None


@dataclass(frozen=True)
class QwenPairs(PairTemplate):
    after_instruction: str  # between the instruction and "<Query>:"
    after_colon: str  # after "<Query>:" and "<Document>:"

    def pieces(self, instruction, query, document, query_visuals="", document_visuals=""):
        return (
            f"<Instruct>: {instruction}{self.after_instruction}<Query>:{self.after_colon}"
            f"{query_visuals}{query}\n<Document>:{self.after_colon}{document_visuals}{document}",
        )


@dataclass(frozen=True)
class MxbaiPairs(PairTemplate):
    def pieces(self, instruction, query, document, query_visuals="", document_visuals=""):
        side = f"query: {query}"
        if instruction:
            side = f"instruction: {instruction}\n{side}"
        return (side, "\n", f"document: {document}")


@dataclass(frozen=True)
class JinaM0Pairs(PairTemplate):
    def refusal(self, text: str, visuals: str) -> str | None:  # its template has no text
        if visuals and (text or visuals.count("<|vision_start|>") > 1):
            held = "text beside an image" if text else "several images"
            return f"holds {held}, and this reranker reads an image alone or a text per side"
        return None

    def pieces(self, instruction, query, document, query_visuals="", document_visuals=""):
        prompt = (
            f"**Document**:\n{document_visuals or document}\n**Query**:\n{query_visuals or query}"
        )
        return (f"{instruction}\n{prompt}" if instruction else prompt,)


TEXT_PAIRS = QwenPairs(
    prefix=QWEN3_PREFIX,
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    default_instruction=DEFAULT_TASK,
    after_instruction="\n",
    after_colon=" ",
)
VISION_PAIRS = QwenPairs(
    prefix=QWEN3_PREFIX,
    suffix="<|im_end|>\n<|im_start|>assistant\n",
    default_instruction=(
        "Given a search query, retrieve relevant candidates that answer the query."
    ),
    after_instruction="",
    after_colon="",
    reads_images=True,
    reads_video=True,
)
MXBAI_PAIRS = MxbaiPairs(
    prefix=(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\n"
    ),
    # The separator, the task and the assistant's turn: one text tokenizes as the three apart
    # (the separator and "<|im_end|>" end pre-tokens whatever follows).
    suffix=(
        "\nYou are a search relevance expert who evaluates how well documents match search "
        "queries. For each query-document pair, carefully analyze the semantic relationship "
        "between them, then provide your binary relevance judgment (0 for not relevant, 1 for "
        "relevant).\nRelevance:<|im_end|>\n<|im_start|>assistant\n"
    ),
    default_instruction=None,
)


JINA_M0_PAIRS = JinaM0Pairs(
    prefix="",
    suffix="",
    default_instruction=None,
    suffix_ids=(100,),  # its score token, whose hidden state the MLP reads
    reads_images=True,
    document_first=True,
)


def pair_template(config: ModelConfig) -> PairTemplate:
    """The published reranker of the checkpoint's family: Qwen3-Reranker or, multimodal,
    Qwen3-VL-Reranker; mxbai-rerank-v2 for Qwen2 (its causal LM, or a converted one-label
    classifier); jina-reranker-m0 by its architecture."""
    if config.mlp_score:
        return JINA_M0_PAIRS
    if config.media is not None:
        return VISION_PAIRS
    return MXBAI_PAIRS if config.family == "qwen2" else TEXT_PAIRS


def pair_tokenizer(model_dir: str | Path, max_input_tokens: int):
    """The reranker's tokenizer: jina-reranker-v3's blocks (listwise.py), a sentence-
    transformers CrossEncoder's chat template (chat_pairs.py), else its family's template."""
    config = ModelConfig.from_dir(model_dir)
    if config.listwise:
        return BlockTokenizer(model_dir, max_input_tokens)
    if config.sentence.logit_score is not None:
        return ChatPairTokenizer(model_dir, max_input_tokens, media=config.media is not None)
    return PairTokenizer(model_dir, max_input_tokens)


class PairTokenizer:
    def __init__(self, model_dir: str | Path, max_input_tokens: int):
        self._tok = load_tokenizer(model_dir)
        self.max_input_tokens = max_input_tokens
        self.template = pair_template(ModelConfig.from_dir(model_dir))
        self._prefix = self._tok.encode(self.template.prefix, add_special_tokens=False).ids
        self._suffix = self._tok.encode(self.template.suffix, add_special_tokens=False).ids
        self._suffix += list(self.template.suffix_ids)
        self.reads_images = self.template.reads_images
        self.reads_video = self.template.reads_video
        self.document_first = self.template.document_first

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
            documents = first_tokens(self._tok, documents, opts.max_document_tokens)
        if document_visuals is None:
            document_visuals = [""] * len(documents)
        if (query_visuals or any(document_visuals)) and not self.reads_images:
            raise RequestError("this reranker reads text only: it takes no images or videos")
        sides = [("QUERY", query, query_visuals)]
        sides += [
            (f"DOCUMENTS[{i}]", *side)
            for i, side in enumerate(zip(documents, document_visuals, strict=True))
        ]
        for name, text, visuals in sides:
            if (why := self.template.refusal(text, visuals)) is not None:
                raise RequestError(f"input '{name}' {why}")
        pairs = [
            self.template.pieces(instruction, query, d, query_visuals, visuals)
            for d, visuals in zip(documents, document_visuals, strict=True)
        ]
        out, heads = [], {}
        for i, ids in enumerate(self._tokenized(pairs)):
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
                if self.template.document_first:
                    piece = (instruction, query, documents[i], query_visuals, visuals)
                    ids = self._document_cut(piece, len(ids) - budget)
                else:
                    ids = ids[:budget]
            out.append(self._prefix + ids + self._suffix)
        return out

    def _document_cut(self, piece: tuple, over: int) -> list[int]:
        """The pair `piece` (pieces' arguments) with its document's text cut by `over` tokens
        and more until the pair fits (its tokens at the cut may merge otherwise)."""
        instruction, query, document, query_visuals, visuals = piece
        own = self._tok.encode(document, add_special_tokens=False)
        budget = self.max_input_tokens - len(self._prefix) - len(self._suffix)
        keep = len(own.ids) - over
        while True:
            text = document[: own.offsets[keep - 1][1]] if keep > 0 else ""
            pieces = self.template.pieces(instruction, query, text, query_visuals, visuals)
            ids = self._tokenized([pieces])[0]
            if len(ids) <= budget or keep <= 0:
                return ids
            keep -= len(ids) - budget

    def _tokenized(self, pairs: list[tuple[str, ...]]) -> list[list[int]]:
        """Each pair's pieces tokenized apart, each distinct text once (the query's side
        repeats), and joined. Without the post-processor's tokens, as the scripts tokenize
        them: the template carries its own special tokens."""
        texts = list(dict.fromkeys(piece for pieces in pairs for piece in pieces))
        encoded = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        ids = {text: enc.ids for text, enc in zip(texts, encoded, strict=True)}
        return [[i for piece in pieces for i in ids[piece]] for pieces in pairs]

    def _head_tokens(self, instruction, query: str, query_visuals: str, visuals: str) -> int:
        # The pieces up to the document's text tokenize the same with or without the text
        # after it (the pre-tokenizer splits at the space; a visual ends in a special token):
        # the part truncation must keep.
        *lead, last = self.template.pieces(instruction, query, "", query_visuals, visuals)
        return len(self._tokenized([(*lead, last.rstrip(" "))])[0])

    def _check_head_fits(self, index: int, head: int, budget: int, field: str | None) -> None:
        if head >= budget:
            what = f"'{field}[{index}]' with 'QUERY'" if field else "'QUERY'"
            hint = f"; {FEWER_FRAMES}" if field and field.endswith("VIDEOS") else ""
            raise RequestError(
                f"input {what} with the template and instruction takes "
                f"{head + len(self._prefix) + len(self._suffix)} tokens, leaving no room "
                f"for a document within the limit of {self.max_input_tokens}{hint}"
            )
