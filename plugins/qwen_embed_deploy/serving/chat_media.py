"""A sentence-transformers MultiVectorEncoder over a multimodal backbone (Qwen3-VL-Embedding
converted, as its ColQwen3-VL-Embedding example does: `modality_config`'s `message`): a text
and its images written as its Transformer module writes them, through the checkpoint's own
chat template.

- The conversation: a system message holding the task's prompt (the checkpoint's) where it has
  one (an empty prompt adds none, as sentence-transformers prepends a prompt only where there
  is one), then one user message of content parts, the images, then the text.
- Rendered in the sandbox transformers renders chat templates in (chat_pairs.compiled), with
  the keyword arguments the checkpoint saves for it (chat_pairs.template_kwargs: a generation
  prompt only where its processing_kwargs ask).
- Each image placeholder the template writes (<|image_pad|>) then stands for as many as the
  image has tokens, as the processor expands it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .chat_pairs import IMAGE_PAD, chat_template, compiled, image_count, placed, template_kwargs

# where the text goes in a render: the template around it is what comes before and after
_TEXT = "\x00text\x00"


@dataclass(frozen=True)
class SentenceChatTemplate:
    template: str
    kwargs: tuple  # (name, value) pairs: the renders are cached by them
    takes_instruction = False  # its prompts, the checkpoint's, are its system turns
    prompted = False
    visuals_per_text = None
    reads_video = False  # its processor samples a video's frames its own way

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> SentenceChatTemplate:
        model_dir = Path(model_dir)
        kwargs, _ = template_kwargs(model_dir)
        found = cls(chat_template(model_dir), tuple(sorted(kwargs.items())))
        try:
            alone = _render(found.template, found.kwargs, "", 0)
        except TypeError:  # the renders are kept by their arguments
            raise ValueError(
                f"{model_dir}: its chat template's arguments {kwargs} must be "
                "plain values (strings, numbers, booleans)"
            ) from None
        one = _render(found.template, found.kwargs, "", 1)
        if alone.count(_TEXT) != 1 or one.count(_TEXT) != 1:
            raise ValueError(f"{model_dir}: its chat template does not write the text once")
        if IMAGE_PAD in alone or one.count(IMAGE_PAD) != 1:
            raise ValueError(
                f"{model_dir}: its chat template does not write one {IMAGE_PAD} per image "
                "part, so its images cannot be placed"
            )
        return found

    def parts(self, instruction: str, visuals: str, video: bool, text: str) -> tuple[str, str, str]:
        """(before, the text, after) of a text after `visuals`, its images' placeholders in
        blocks (tokenizer.image_blocks), each image's <|image_pad|> repeated as there."""
        rendered = _render(self.template, self.kwargs, instruction, image_count(visuals))
        before, after = rendered.split(_TEXT)
        return placed(before, visuals), text, after


@lru_cache(maxsize=256)
def _render(template: str, kwargs: tuple, system: str, images: int) -> str:
    """A render of `images` images and the text (`_TEXT`), after `system` if any: the same
    for every text of a prompt and image count, so rendered once for them."""
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}]
    content = [{"type": "image"}] * images + [{"type": "text", "text": _TEXT}]
    messages = messages[not system :] + [{"role": "user", "content": content}]
    return compiled(template).render(messages=messages, tools=None, documents=None, **dict(kwargs))
