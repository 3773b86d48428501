"""(query, documents) -> token ids for a causal-LM reranker in sentence-transformers'
CrossEncoder form (modules.json: Transformer, then LogitScore; qwen_embed.sentence_modules),
formed as its `predict` forms them:

- a pair is two messages, role `query` and role `document`, after a `system` message holding
  the instruction where there is one (the request's, else the prompt its
  config_sentence_transformers.json names by default: sentence-transformers passes a prompt so);
  their content is the text, or typed parts where its message format is `structured` (a
  multimodal backbone's, Qwen3-VL-Reranker's: each side's images as image parts before its
  text, each placeholder the template writes then repeated for its image's tokens, as the
  processor expands it; a pair with images is not cut, videos are not read);
- they are rendered through the checkpoint's chat template (`chat_template.jinja`, else
  tokenizer_config.json's) in the sandbox transformers renders chat templates in (`compiled`:
  jinja2, which torch depends on, so every image that serves has it), with its special tokens
  and the keyword arguments sentence_bert_config.json keeps for it
  (`processing_kwargs.chat_template`, e.g. `add_generation_prompt`), and tokenized whole,
  without the post-processor's tokens;
- a pair over the limit is cut there and the template's tail written back over its end: the
  longest common token suffix of two renders with other contents, so the model still reads
  its last token where the template puts it.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from qwen_embed.loader import read_json
from qwen_embed_client.contract import RequestError, RerankOptions

from .tokenizer import PromptSet, first_tokens, load_tokenizer, token_text

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
# keyword arguments of apply_chat_template that size or pad the output: limits are ours
_SIZE_KWARGS = ("truncation", "max_length", "padding", "pad_to_multiple_of", "return_tensors")
# contents that tokenize apart from the template around them, for its tail (as
# sentence-transformers finds it)
_FILLERS = ("0", "1 2 3 4")


@lru_cache(maxsize=8)
def compiled(template: str):
    """A chat template compiled as transformers compiles one: an immutable sandbox, blocks
    trimmed, loop controls, its `tojson` (no HTML escapes), `raise_exception`, `strftime_now`,
    and `dict` / `namespace` that cannot reach Python internals (templates come with the
    checkpoint)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        # earlier sandboxes can be escaped
        raise ImportError(f"chat templates need jinja2 >= 3.1.6, this is {jinja2.__version__}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class Dicts:  # dict() and dict.fromkeys() only
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):  # no attribute that starts with "_"
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals |= {
        "raise_exception": raise_exception,
        "strftime_now": lambda format: datetime.now().strftime(format),
        "dict": Dicts(),
        "namespace": Namespace,
    }
    return env.from_string(template)


def chat_template(model_dir: Path) -> str:
    """The checkpoint's chat template, where transformers finds it."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = read_json(model_dir / "tokenizer_config.json", {}).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not isinstance(template, str):
        raise ValueError(
            f"{model_dir} is a causal-LM CrossEncoder without a chat template "
            "(chat_template.jinja): its query/document pairs cannot be formed"
        )
    return template


def template_kwargs(model_dir: Path) -> tuple[dict, bool]:
    """The keyword arguments sentence-transformers renders the checkpoint's chat template
    with: its special tokens, then sentence_bert_config.json's
    `processing_kwargs.chat_template` but the sizes (limits are ours), no generation prompt
    unless that asks; and whether a text cut at the limit gets the template's tail back
    (`restore_suffix`)."""
    config = read_json(model_dir / "tokenizer_config.json", {})
    specials = {k: token_text(config.get(k)) for k in SPECIAL_TOKENS}
    st = read_json(model_dir / "sentence_bert_config.json", {})
    kwargs = dict((st.get("processing_kwargs") or {}).get("chat_template") or {})
    restore = kwargs.pop("restore_suffix", True)
    for key in _SIZE_KWARGS:
        kwargs.pop(key, None)
    named = {k: v for k, v in specials.items() if v is not None}
    return {"add_generation_prompt": False} | named | kwargs, restore


IMAGE_PAD = "<|image_pad|>"
_VISION_END = "<|vision_end|>"  # ends each image's block in tokenizer.image_blocks


def image_count(visuals: str) -> int:
    """The images in `visuals`, their placeholders in blocks (tokenizer.image_blocks)."""
    return visuals.count(_VISION_END)


def placed(rendered: str, visuals: str) -> str:
    """`rendered` with each image placeholder a chat template writes (one <|image_pad|> per
    image part) repeated as many times as its image in `visuals` (tokenizer.image_blocks, in
    the render's order) has tokens, as the processor expands them."""
    counts = [block.count(IMAGE_PAD) for block in visuals.split(_VISION_END)[:-1]]
    pieces = rendered.split(IMAGE_PAD)
    if len(pieces) != len(counts) + 1:
        raise RequestError(
            f"holds {len(pieces) - 1 - len(counts)} {IMAGE_PAD} of its own beside its images"
        )
    return "".join(p + IMAGE_PAD * n for p, n in zip(pieces, counts + [0], strict=True))


class ChatPairTokenizer:
    reads_video = False  # its processor samples a video's frames its own way

    def __init__(self, model_dir: str | Path, max_input_tokens: int, *, media: bool):
        """`media`: its backbone has a vision tower (ModelConfig.media)."""
        model_dir = Path(model_dir)
        self._tok = load_tokenizer(model_dir)
        self.max_input_tokens = max_input_tokens
        self._template = compiled(chat_template(model_dir))
        self._kwargs, self._restore = template_kwargs(model_dir)
        st = read_json(model_dir / "sentence_bert_config.json", {})
        message = (st.get("modality_config") or {}).get("message") or {}
        # content as typed parts, as a multimodal backbone's templates read them
        self._structured = message.get("format") == "structured"
        self.reads_images = self._structured and media
        rendered = self._rendered([self._messages(None, "\x00query", "\x00document")])[0]
        self.document_first = rendered.find("\x00document") < rendered.find("\x00query")
        # sentence-transformers' default prompt, which it passes as the system message
        self.default_instruction = PromptSet.from_dir(model_dir).resolve(None, None, None) or None

    def encode(
        self,
        query: str,
        documents: list[str],
        opts: RerankOptions,
        query_visuals: str = "",
        document_visuals: list[str] | None = None,
        fields: list[str] | None = None,
    ) -> list[list[int]]:
        """One sequence per document; `query_visuals`, `document_visuals` (a multimodal
        backbone): each side's images' placeholders (tokenizer.image_blocks), the query's in
        every pair, each an image part of its message before its text; `fields`: per document,
        the input a refusal names."""
        instruction = opts.instruction or self.default_instruction
        if opts.max_document_tokens is not None:
            documents = first_tokens(self._tok, documents, opts.max_document_tokens)
        document_visuals = document_visuals or [""] * len(documents)
        pairs = list(zip(documents, document_visuals, strict=True))
        conversations = [self._messages(instruction, query, d, query_visuals, v) for d, v in pairs]
        texts = self._rendered(conversations)
        for i, (_, visuals) in enumerate(pairs if self.reads_images else ()):
            sides = (visuals, query_visuals) if self.document_first else (query_visuals, visuals)
            try:
                texts[i] = placed(texts[i], "".join(sides))
            except RequestError as e:
                raise RequestError(f"input 'DOCUMENTS[{i}]' with 'QUERY' {e}") from None
        out, tail = [], None
        for i, enc in enumerate(self._tok.encode_batch_fast(texts, add_special_tokens=False)):
            ids = enc.ids
            if len(ids) > self.max_input_tokens:
                if query_visuals or document_visuals[i]:
                    field = fields[i] if fields else "DOCUMENT_IMAGES"
                    raise RequestError(
                        f"input '{field}[{i}]' with 'QUERY' makes a pair of {len(ids)} tokens, "
                        f"more than the limit of {self.max_input_tokens}: a pair with images "
                        "is not cut (send smaller images or shorter texts)"
                    )
                if not opts.truncate:
                    raise RequestError(
                        f"input 'DOCUMENTS[{i}]' makes a pair of {len(ids)} tokens, more than "
                        f"the limit of {self.max_input_tokens} (send truncate=true to cut it)"
                    )
                if tail is None:  # once per request: it depends on the instruction
                    tail = self._tail(instruction) if self._restore else []
                ids = ids[: self.max_input_tokens - len(tail)] + tail
            out.append(ids)
        return out

    def _messages(
        self,
        instruction: str | None,
        query: str,
        document: str,
        query_visuals: str = "",
        document_visuals: str = "",
    ) -> list[dict]:
        """The pair as sentence-transformers writes it: the instruction as a system message,
        then a `query` and a `document` message; typed parts where the model's message format
        is structured (each image a part, before the text; an image alone has no text part)."""

        def content(text: str, visuals: str):
            if not self._structured:
                return text
            images = [{"type": "image"}] * image_count(visuals)
            return images + ([{"type": "text", "text": text}] if text or not images else [])

        system = [{"role": "system", "content": content(instruction, "")}] if instruction else []
        return system + [
            {"role": "query", "content": content(query, query_visuals)},
            {"role": "document", "content": content(document, document_visuals)},
        ]

    def _rendered(self, conversations: list[list[dict]]) -> list[str]:
        """Each conversation rendered as transformers' apply_chat_template renders it."""
        return [
            self._template.render(messages=c, tools=None, documents=None, **self._kwargs)
            for c in conversations
        ]

    def _tail(self, instruction: str | None) -> list[int]:
        """The template's tokens after a pair's contents: what two renders with other
        contents (the system message kept) end in alike; none where they never differ."""
        a, b = (
            self._tok.encode(text, add_special_tokens=False).ids
            for text in self._rendered([self._messages(instruction, f, f) for f in _FILLERS])
        )
        n = 0
        while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
            n += 1
        return a[len(a) - n :][-self.max_input_tokens :] if n < min(len(a), len(b)) else []
