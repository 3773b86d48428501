"""How a multi-vector retriever's processor writes its inputs (qwen_embed.config.
MULTI_VECTOR_ARCHITECTURES): a text alone is a query, a text with its image (one per text) a
document page; videos are not read (their processors sample frames their own ways, which are
not reproduced here).

- tomoro-colqwen3-embed (ColQwen3Processor, `ColPaliTemplate`): a query is the processor's
  query prefix (none by default), the text stripped, then ten query-augmentation tokens (the
  tokenizer's pad token), which the model was trained to fill with what the query implies; a
  page is one user turn holding the image's placeholders and "Describe the image.", the text
  after a space where there is one, then `<|im_end|><|endoftext|>` and no assistant turn.
  processor_config.json may set the prefixes and suffix and the visual token budget
  (`max_num_visual_tokens`, 1,280 by default), as the processor's own arguments.
- ColQwen2 as transformers ports it (vidore/colqwen2-v1.0-hf; ColQwen2Processor, the same
  `ColPaliTemplate` written its way): a query is `Query: ` (its `query_prefix`), the text as
  sent, ten augmentation tokens (the pad token) and a newline; a page is its
  `visual_prompt_prefix` alone (one user turn holding the image's placeholders and "Describe
  the image.", then `<|im_end|><|endoftext|>`): no text goes with a page. Images within its
  image processor's budget (preprocessor_config.json's min_pixels and max_pixels).
- ColQwen2, ColQwen2.5 and ColQwen3.5 as colpali-engine saves them (vidore/colqwen2-v1.0,
  colqwen2.5-v0.2, colqwen3.5-4.5B-v3; its ColQwen2Processor, ColQwen2_5_Processor and
  ColQwen3_5Processor, `ColPaliTemplate` too): pages as the port writes them; a query is the
  prefix its checkpoints were trained with, the text as sent and ten `<|endoftext|>` (its
  `query_augmentation_token`), no newline. ColQwen2(.5)'s prefix is `Query: ` (colpali-engine
  up to 0.3.10, which trained the published checkpoints; MTEB's evaluation puts it back to
  reproduce their scores); ColQwen3.5 came with later versions, which write none.
- nemotron-colembed-vl-v2 (Qwen3VLNemotronEmbedProcessor, `NemotronTemplate`): Qwen3-VL's chat
  turn up to where the assistant's answer begins, holding `Query: {query_prefix} {text}`, or
  the image's placeholders and `{passage_prefix} {text}` (processor_config.json's prefixes,
  `query:` and `passage:` by default); images within its image processor's budget.

jina-embeddings-v4 (JinaEmbeddingsV4Processor, `JinaV4Template`), a pooled embedder with its
own processor too: a text is its prompt (`Query: ` or `Passage: `, JINA_V4_PROMPTS) and the
text, as any prompted text; an image is one user turn holding its placeholders and "Describe
the image.", alone (no text with it), within its image processor's budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qwen_embed.config import MULTI_VECTOR_ARCHITECTURES, gme_architectures
from qwen_embed.loader import read_json
from qwen_embed_client.contract import RequestError

AUGMENTATION_TOKENS = 10
# colpali-engine's classes' architectures, and the query prefix each was trained with: its
# processors wrote `Query: ` up to 0.3.10, none since (ColQwen3.5's)
COLPALI_ENGINE = {"ColQwen2": "Query: ", "ColQwen2_5": "Query: ", "ColQwen3_5": ""}
# ColQwen3Processor.from_pretrained's default: text-model tokens per image at most
MAX_VISUAL_TOKENS = 1280
_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_ANSWER = "<|im_end|>\n<|im_start|>assistant\n"


JINA_V4 = "JinaEmbeddingsV4Model"
# its encode_text's prompt names (`query` its default) and prefixes; `document` is the name our
# APIs give the passage side
JINA_V4_PROMPTS = {"query": "Query: ", "passage": "Passage: ", "document": "Passage: "}


def architectures(model_dir: str | Path) -> list[str]:
    """config.json's architectures, GME's first saves named as GME (config.gme_architectures)."""
    names = read_json(Path(model_dir) / "config.json", {}).get("architectures") or []
    return gme_architectures(model_dir, names)


def retriever(model_dir: str | Path) -> str | None:
    """The checkpoint's multi-vector architecture, None for any other model."""
    return next((a for a in architectures(model_dir) if a in MULTI_VECTOR_ARCHITECTURES), None)


def is_jina_v4(model_dir: str | Path) -> bool:
    return JINA_V4 in architectures(model_dir)


def own_processor(model_dir: str | Path) -> bool:
    """Whether the checkpoint's images are sized by its processor's budget (a multi-vector
    retriever, jina-embeddings-v4), not Qwen3-VL-Embedding's script's."""
    return retriever(model_dir) is not None or is_jina_v4(model_dir)


def _processor(model_dir: str | Path) -> dict:
    return read_json(Path(model_dir) / "processor_config.json", {})


@dataclass(frozen=True)
class ColPaliTemplate:
    query_prefix: str
    augmentation: str  # the pad token, AUGMENTATION_TOKENS times
    image_prefix: str = f"<|im_start|>user\n{_IMAGE}Describe the image."
    image_suffix: str = "<|im_end|><|endoftext|>"
    strip: bool = True  # ColQwen3's processor strips the text; ColQwen2's does not
    query_end: str = ""  # after the augmentation: ColQwen2's newline
    page_text: bool = True  # whether a text may go with a page (ColQwen2's: the image alone)
    takes_instruction = False  # a prompt (parameter 'prompt') goes before the text
    prompted = False
    visuals_per_text = 1
    reads_video = False

    @classmethod
    def from_dir(cls, model_dir: str | Path, pad: str | None) -> ColPaliTemplate:
        """`pad`: the tokenizer's pad token (tokenizer_config.json)."""
        if pad is None:
            raise ValueError(f"{model_dir}: no pad_token, the queries' augmentation token")
        processor = _processor(model_dir)
        architecture = retriever(model_dir)
        if architecture in ("ColQwen2ForRetrieval", *COLPALI_ENGINE):
            prefix = processor.get("visual_prompt_prefix") or (
                f"<|im_start|>user\n{_IMAGE}Describe the image.<|im_end|><|endoftext|>"
            )
            port = architecture == "ColQwen2ForRetrieval"
            trained = "Query: " if port else COLPALI_ENGINE[architecture]
            return cls(
                query_prefix=processor.get("query_prefix") or trained,
                augmentation=(pad if port else "<|endoftext|>") * AUGMENTATION_TOKENS,
                image_prefix=prefix,
                image_suffix="",
                strip=False,
                query_end="\n" if port else "",
                page_text=False,
            )
        names = {
            "query_prefix": "query_prefix",
            "image_prefix": "visual_prompt_prefix",
            "image_suffix": "visual_prompt_suffix",
        }
        given = {ours: processor[theirs] for ours, theirs in names.items() if processor.get(theirs)}
        return cls(**{"query_prefix": "", **given, "augmentation": pad * AUGMENTATION_TOKENS})

    def parts(self, instruction, visual: str, video: bool, text: str) -> tuple[str, str, str]:
        """(before, the text, after) of a text with `visual`, its image's placeholders ("" for
        none); `instruction` and `video` are not read (takes_instruction, reads_video)."""
        text = text.strip() if self.strip else text
        if not visual:
            return self.query_prefix, text, self.augmentation + self.query_end
        if text and not self.page_text:
            raise RequestError(
                "holds text beside its image, and this model's pages are an image alone (its "
                "processor writes no text with them): send the text as an input of its own"
            )
        before = self.image_prefix.replace(_IMAGE, visual, 1) + (" " if text else "")
        return before, text, self.image_suffix


@dataclass(frozen=True)
class NemotronTemplate:
    query_prefix: str = "query:"
    passage_prefix: str = "passage:"
    takes_instruction = False
    prompted = False
    visuals_per_text = 1
    reads_video = False

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> NemotronTemplate:
        processor = _processor(model_dir)
        given = {k: processor[k] for k in ("query_prefix", "passage_prefix") if k in processor}
        return cls(**given)

    def parts(self, instruction, visual: str, video: bool, text: str) -> tuple[str, str, str]:
        """(before, the text, after) as its processor's chat turn writes them."""
        if not visual:
            prefix = f"{self.query_prefix} " if self.query_prefix else ""
            return f"<|im_start|>user\nQuery: {prefix}", text, _ANSWER
        prefix = f"{self.passage_prefix} " if self.passage_prefix else ""
        return f"<|im_start|>user\n{visual}{prefix}", text, _ANSWER


@dataclass(frozen=True)
class JinaV4Template:
    image_text: str = f"<|im_start|>user\n{_IMAGE}Describe the image.<|im_end|>\n"
    takes_instruction = False
    # a text alone is its prompt and the text, as any text model's (no template); `parts`
    # takes the request's prompt (PromptSet.resolve's)
    prompted = True
    visuals_per_text = 1
    reads_video = False

    def parts(self, prompt: str, visual: str, video: bool, text: str) -> tuple[str, str, str]:
        """(before, the text, after): a text after its prompt, or an image's turn alone."""
        if not visual:
            return prompt, text, ""
        if text:
            raise RequestError(
                "holds text beside its image, and this model embeds an image alone (its "
                "processor writes no text with it): send the text as an input of its own"
            )
        return self.image_text.replace(_IMAGE, visual, 1), "", ""


def pixel_budget(model_dir: str | Path, least: int, most: int, factor: int) -> tuple[int, int]:
    """(least, most) pixels of an image for a multi-vector retriever's processor, from its
    image processor's (`least`, `most`: preprocessor_config.json's size): ColQwen3's caps it
    at its token budget (`max_num_visual_tokens` tokens of `factor` x `factor` pixels)."""
    if retriever(model_dir) == "ColQwen3":
        tokens = _processor(model_dir).get("max_num_visual_tokens", MAX_VISUAL_TOKENS)
        return least, int(tokens) * factor**2
    return least, most


def retriever_template(model_dir: str | Path, pad: str | None):
    """The processor's forms of a multi-vector retriever's checkpoint or jina-embeddings-v4's;
    None for another."""
    architecture = retriever(model_dir)
    if architecture in ("ColQwen3", "ColQwen2ForRetrieval", *COLPALI_ENGINE):
        return ColPaliTemplate.from_dir(model_dir, pad)
    if architecture == "Qwen3VLNemotronEmbedModel":
        return NemotronTemplate.from_dir(model_dir)
    return JinaV4Template() if is_jina_v4(model_dir) else None
