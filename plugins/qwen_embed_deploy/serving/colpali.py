"""How a ColPali-style retriever's processor writes its inputs (tomoro-colqwen3-embed's
ColQwen3Processor), for its multi-vector model (qwen_embed.config.MULTI_VECTOR_ARCHITECTURES):

- a text alone is a query: the processor's query prefix (none by default), the text stripped,
  then ten query-augmentation tokens (the tokenizer's pad token), which the model was trained
  to fill with what the query implies;
- a text with its image (one per text) is a document: one user turn holding the image's
  placeholders and "Describe the image.", the text after a space where there is one, then
  `<|im_end|><|endoftext|>` and no assistant turn.

processor_config.json may set the prefixes and suffixes and the visual token budget
(`max_num_visual_tokens`), as the processor's own arguments. Videos are not read: the
processor samples their frames its own way, which is not reproduced here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qwen_embed.config import MULTI_VECTOR_ARCHITECTURES

AUGMENTATION_TOKENS = 10
# ColQwen3Processor.from_pretrained's default: text-model tokens per image at most
MAX_VISUAL_TOKENS = 1280
_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def colpali(model_dir: str | Path) -> bool:
    """Whether the checkpoint is a multi-vector retriever written by a ColPali processor."""
    architectures = _json(Path(model_dir) / "config.json").get("architectures") or ()
    return bool(MULTI_VECTOR_ARCHITECTURES & set(architectures))


def max_visual_tokens(model_dir: str | Path) -> int:
    """Text-model tokens per image at most (the processor's `max_num_visual_tokens`)."""
    processor = _json(Path(model_dir) / "processor_config.json")
    return int(processor.get("max_num_visual_tokens", MAX_VISUAL_TOKENS))


@dataclass(frozen=True)
class ColPaliTemplate:
    query_prefix: str
    augmentation: str  # the pad token, AUGMENTATION_TOKENS times
    image_prefix: str = f"<|im_start|>user\n{_IMAGE}Describe the image."
    image_suffix: str = "<|im_end|><|endoftext|>"
    takes_instruction = False  # a prompt (parameter 'prompt') goes before the text
    visuals_per_text = 1
    reads_video = False

    @classmethod
    def from_dir(cls, model_dir: str | Path, pad: str | None) -> ColPaliTemplate:
        """`pad`: the tokenizer's pad token (tokenizer_config.json)."""
        if pad is None:
            raise ValueError(f"{model_dir}: no pad_token, the queries' augmentation token")
        processor = _json(Path(model_dir) / "processor_config.json")
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
        text = text.strip()
        if not visual:
            return self.query_prefix, text, self.augmentation
        before = self.image_prefix.replace(_IMAGE, visual, 1) + (" " if text else "")
        return before, text, self.image_suffix
