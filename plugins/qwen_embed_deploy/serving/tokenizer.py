"""Text -> token ids for one request: the checkpoint's prompts, special tokens and truncation.

Special tokens are added as the model's own tokenizer adds them: whatever tokenizer.json's
post-processor adds (Qwen3-Embedding appends <|endoftext|>), plus a BOS/EOS that
tokenizer_config.json's `add_bos_token`/`add_eos_token` asks for and the post-processor does not
already add (gte-Qwen2's remote-code tokenizer appends its EOS that way). Truncation cuts the
text, from the end (`right`) or the start (`left`), and always keeps those special tokens:
last-token pooling reads the appended EOS.

The prompts a checkpoint defines are read as sentence-transformers reads them (`PromptSet`):
`config_sentence_transformers.json` names prompts (`{"prompts": {"query": "...", ...},
"default_prompt_name": ...}`); sentence-transformers prepends the chosen one to every text, and so
do we. A sentence-transformers checkpoint without that file (a `modules.json` alone, as
pplx-embed ships) has no prompts, nor has a multimodal one (its texts are written in its chat
template) or one whose remote code's recipe has none (pplx-embed-context); a bare transformers
checkpoint gets Qwen3-Embedding's. A MultiVectorEncoder's `query` and `document` prompts name
its tasks (late_interaction.py), served with an empty prompt where it saves none.
`instruction` fills the task slot of the model's own query prompt (`Instruct: {task}\\nQuery:`
plus whatever the model puts after it); a raw `prompt` is a literal prefix for everything else.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qwen_embed.config import (
    CONTEXTUAL_ARCHITECTURES,
    GME,
    PLAIN_TOKENS_ARCHITECTURES,
    REMOTE_CODE_HEADS,
)
from qwen_embed.loader import CheckpointError, lfs_pointer, read_json, unreadable
from qwen_embed.sentence_modules import SENTENCE_TRANSFORMERS_CONFIG
from qwen_embed_client.contract import (
    DEFAULT_TASK,
    FEWER_FRAMES,
    MAX_CHUNKS,
    TRUNCATION_DIRECTIONS,
    EmbedOptions,
    Finish,
    RequestError,
)

from .late_interaction import LateInteraction, is_late_interaction
from .retrievers import (
    JINA_V4_PROMPTS,
    architectures,
    is_jina_v4,
    own_processor,
    retriever,
    retriever_template,
)

QWEN3_EMBEDDING_PROMPTS = {"query": f"Instruct: {DEFAULT_TASK}\nQuery:", "document": ""}
# Qwen3-Embedding's and gte-Qwen2's query prompts: a task between "Instruct: " and "\nQuery:".
_TASK_SLOT = re.compile(r"^Instruct: (?P<task>.*)\nQuery:(?P<tail>[ \t]*)$", re.S)


def _config(model_dir: str | Path) -> dict:
    return read_json(Path(model_dir) / "config.json", {})


def multimodal(model_dir: str | Path) -> bool:
    """Whether the checkpoint has a vision side (config.json's `vision_config`: Qwen3-VL,
    Qwen2-VL; ColQwen2's within its `vlm_config`)."""
    config = _config(model_dir)
    return "vision_config" in config.get("vlm_config", config)


@dataclass(frozen=True)
class PromptSet:
    prompts: dict[str, str]
    default_name: str | None
    source: str  # where they came from, for messages and `qwen-embed info`

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> PromptSet:
        path = Path(model_dir) / SENTENCE_TRANSFORMERS_CONFIG
        if is_jina_v4(model_dir):  # its remote code's prefixes, whatever the file says
            return cls(dict(JINA_V4_PROMPTS), "query", "jina-embeddings-v4's encode_text")
        if not path.is_file():
            if retriever(model_dir) is not None:
                return cls({}, None, "its processor's query and page forms (retrievers.py)")
            if GME in architectures(model_dir):
                return cls({}, None, "GME's script (the instruction its system turn)")
            if multimodal(model_dir):
                return cls({}, None, "Qwen3-VL's chat template (the instruction its system turn)")
            if (Path(model_dir) / "modules.json").is_file():
                return cls({}, None, f"{model_dir} (a sentence-transformers model without prompts)")
            remote = REMOTE_CODE_HEADS.keys() | PLAIN_TOKENS_ARCHITECTURES
            if remote & set(_config(model_dir).get("architectures") or ()):
                return cls({}, None, f"{model_dir} (its remote code's recipe, without prompts)")
            return cls(dict(QWEN3_EMBEDDING_PROMPTS), None, "Qwen3-Embedding's prompts")
        config = read_json(path)
        prompts = config.get("prompts") or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
            raise ValueError(f"{path}: 'prompts' must map names to strings")
        default = config.get("default_prompt_name")
        if default is not None and default not in prompts:
            raise ValueError(f"{path}: default_prompt_name {default!r} is not in its prompts")
        if is_late_interaction(model_dir):  # its tasks, prompted or not
            prompts = {"query": "", "document": "", **prompts}
        return cls(dict(prompts), default, str(path))

    @property
    def names(self) -> list[str]:
        return sorted(self.prompts)

    def instruction_prompt(self, instruction: str) -> str:
        """The model's query prompt with `instruction` as its task."""
        query = self.prompts.get("query")
        slot = _TASK_SLOT.match(query) if query is not None else None
        if slot is None:
            raise RequestError(
                "parameter 'instruction' needs a 'query' prompt of the form "
                f"'Instruct: ...\\nQuery:', and this model's is {query!r}; send the whole "
                "prefix as parameter 'prompt' instead"
            )
        return f"Instruct: {instruction}\nQuery:{slot.group('tail')}"

    def resolve(self, prompt_name: str | None, instruction: str | None, prompt: str | None) -> str:
        """The prefix for a request's texts ("" for none); options already validated."""
        if prompt is not None:
            return prompt
        if instruction is not None:
            return self.instruction_prompt(instruction)
        name = prompt_name if prompt_name is not None else self.default_name
        return self.prompts[name] if name is not None else ""


# Qwen3-VL-Embedding's script: the instruction is the system turn (a full stop added where it
# ends without punctuation); the user turn holds the videos, the images, then the text.
DEFAULT_MEDIA_INSTRUCTION = "Represent the user's input."


def image_blocks(image_tokens: list[int]) -> str:
    """Images in a Qwen3-VL prompt, each its placeholders (`image_tokens`: their counts)
    between <|vision_start|> and <|vision_end|>, as its chat template and processor write
    them."""
    return "".join(f"<|vision_start|>{'<|image_pad|>' * n}<|vision_end|>" for n in image_tokens)


@dataclass(frozen=True)
class ChatTemplate:
    """How a multimodal checkpoint's texts are written (Qwen3-VL-Embedding's script): every
    text, with images and videos or without, in one chat turn after the instruction, ending
    where the assistant's answer would begin."""

    takes_instruction = True
    prompted = False
    visuals_per_text = None  # any number
    reads_video = True
    default_instruction = DEFAULT_MEDIA_INSTRUCTION

    def system(self, instruction: str | None) -> str:
        """The system turn for a request's instruction (else the default), as the script
        writes it: ending in punctuation (a full stop added where it has none)."""
        instruction = (instruction or self.default_instruction).strip()
        if instruction and unicodedata.category(instruction[-1])[0] != "P":
            instruction += "."
        return instruction

    def parts(self, instruction: str, visuals: str, video: bool, text: str) -> tuple[str, str, str]:
        """(the turn up to the text, the text, what follows it) of a text after `visuals`, its
        videos' and images' placeholders; `instruction` the system turn (none where it is
        empty: a checkpoint's empty prompt, which sentence-transformers leaves out)."""
        system = f"<|im_start|>system\n{instruction}<|im_end|>\n" if instruction else ""
        before = f"{system}<|im_start|>user\n{visuals}"
        return before, text, "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class GmeTemplate:
    """How GME's script (gme_inference.py's `embed`) writes a text: the instruction as it is
    (a query's own, else its default) the system turn, the user turn holding the image's
    placeholders and then the text, the assistant's turn begun and <|endoftext|> after it,
    the token whose state is the vector. One image per text, no video."""

    takes_instruction = True
    prompted = False
    visuals_per_text = 1
    reads_video = False
    default_instruction = "You are a helpful assistant."

    def system(self, instruction: str | None) -> str:
        return instruction or self.default_instruction

    def parts(self, instruction: str, visuals: str, video: bool, text: str) -> tuple[str, str, str]:
        before = f"<|im_start|>system\n{instruction}<|im_end|>\n<|im_start|>user\n{visuals}"
        return before, text, "<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"


def media_template(model_dir: Path):
    """How the checkpoint writes texts with images and video: its processor's forms (a
    multi-vector retriever's or jina-embeddings-v4's: retrievers.py), Qwen3-VL-Embedding's
    chat turn, a sentence-transformers MultiVectorEncoder's render of its own chat template
    (chat_media.py), or None (it reads text only)."""
    if own_processor(model_dir):
        config = read_json(model_dir / "tokenizer_config.json", {})
        return retriever_template(model_dir, token_text(config.get("pad_token")))
    if GME in architectures(model_dir):
        return GmeTemplate()
    if not multimodal(model_dir):
        return None
    if is_late_interaction(model_dir):
        from .chat_media import SentenceChatTemplate  # it renders through chat_pairs, which
        # reads checkpoints through this module

        return SentenceChatTemplate.from_dir(model_dir)
    return ChatTemplate()


def tokenizer_file(model_dir: str | Path) -> Path:
    """The checkpoint's tokenizer.json, there and not a Git LFS pointer (CheckpointError
    otherwise): what the launcher checks before any server starts, where building the
    tokenizer would cost the start a share of a second per tokenizer model."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no tokenizer.json (the checkpoint's tokenizer)")
    if (pointer := lfs_pointer(path)) is not None:
        raise CheckpointError(pointer)
    return path


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer.json with its own truncation and padding off: the limits are
    ours (per request), and every sequence keeps its own length."""
    from tokenizers import Tokenizer

    path = tokenizer_file(model_dir)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises Exception with the parser's words
        problem = f"is not a tokenizer the tokenizers library reads: {e}"
        raise CheckpointError(unreadable(path, problem)) from None
    tok.no_truncation()
    tok.no_padding()
    return tok


def first_tokens(tok, texts: list[str], n: int) -> list[str]:
    """Each text up to the end of its n-th token (tokenized alone)."""
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    return [
        text[: enc.offsets[n - 1][1]] if len(enc.ids) > n else text
        for text, enc in zip(texts, encoded, strict=True)
    ]


def token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def chunk_separator(model_dir: str | Path) -> str | None:
    """What a contextual checkpoint's recipe joins a document's chunks with
    (CONTEXTUAL_ARCHITECTURES: pplx-embed-context): its tokenizer's sep_token
    (tokenizer_config.json, else special_tokens_map.json, as transformers reads it); None for
    every other checkpoint."""
    if not CONTEXTUAL_ARCHITECTURES & set(_config(model_dir).get("architectures") or ()):
        return None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        text = token_text(read_json(Path(model_dir) / name, {}).get("sep_token"))
        if text is not None:
            return text
    return None


def special_tokens(tok, model_dir: Path) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the text's own tokens, as the model's tokenizer adds them
    (none where the model's recipe leaves them out: PLAIN_TOKENS_ARCHITECTURES)."""
    if PLAIN_TOKENS_ARCHITECTURES & set(_config(model_dir).get("architectures") or ()):
        return [], []
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a").ids
    start = next(i for i in range(len(full)) if full[i : i + len(plain)] == plain)
    head, tail = full[:start], full[start + len(plain) :]
    path = model_dir / "tokenizer_config.json"
    config = read_json(path, {})
    for flag, key in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        name = token_text(config.get(key))
        if not config.get(flag) or name is None:
            continue
        token_id = tok.token_to_id(name)
        if token_id is None:
            raise ValueError(f"{path}: {key} {name!r} is not in tokenizer.json")
        if flag == "add_bos_token" and head[:1] != [token_id]:
            head = [token_id] + head
        if flag == "add_eos_token" and tail[-1:] != [token_id]:
            tail = tail + [token_id]
    return head, tail


@dataclass(frozen=True)
class TextChunks:
    """A text's chunks: token spans over its ids (prompt and special tokens included, as the
    encoder receives them), the characters of the text each covers, and how many special
    tokens follow the text (the model's read-out, chunking.py)."""

    tokens: np.ndarray  # int64 [k, 2]
    chars: np.ndarray  # int32 [k, 2]
    tail: int


class TextTokenizer:
    def __init__(
        self, model_dir: str | Path, max_input_tokens: int, truncation_direction: str = "right"
    ):
        if truncation_direction not in TRUNCATION_DIRECTIONS:
            raise ValueError(
                f"truncation_direction must be 'left' or 'right', not {truncation_direction!r}"
            )
        model_dir = Path(model_dir)
        self._tok = load_tokenizer(model_dir)
        self.max_input_tokens = max_input_tokens
        self.truncation_direction = truncation_direction
        self.prompts = PromptSet.from_dir(model_dir)
        # A multimodal checkpoint writes every text in its template (a chat turn, or a
        # retriever's processor's query and page forms); its prompts (where it names any)
        # are instructions.
        self.chat = media_template(model_dir)
        self._head, self._tail = special_tokens(self._tok, model_dir)
        self.separator = chunk_separator(model_dir)
        self._separator_id = (
            None if self.separator is None else self._tok.token_to_id(self.separator)
        )
        if self.separator is not None and self._separator_id is None:
            raise ValueError(f"{model_dir}: sep_token {self.separator!r} is not in tokenizer.json")
        self._special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.late = LateInteraction.from_dir(model_dir, self._tok)

    def encode(self, texts: list[str], opts: EmbedOptions) -> list[list[int]]:
        return self.encode_counted(texts, opts)[0]

    def finish(self, opts: EmbedOptions) -> Finish:
        """The encoder's share of the request: its options, and whether a MultiVectorEncoder's
        skiplist leaves tokens out of its texts' vectors (late_interaction.py)."""
        finish = opts.finish()
        if self.late is None or not finish.per_token:
            return finish
        return dataclasses.replace(finish, skiplist=self.late.skips(self._task(opts)))

    def _task(self, opts: EmbedOptions) -> str | None:
        """A MultiVectorEncoder's task for the request: its prompt's name, or the default's."""
        return self.late.task(opts.prompt_name or self.prompts.default_name)

    def encode_counted(
        self, texts: list[str], opts: EmbedOptions
    ) -> tuple[list[list[int]], list[int]]:
        """(ids per text, tokens per text before truncation, special tokens included)."""
        return ids_and_counts(self.encoded(texts, opts))

    def encoded(self, texts: list[str], opts: EmbedOptions, offsets: bool = False) -> list[Encoded]:
        """Each text's Encoded: its ids and counts; with `offsets`, what `tokens` shows of
        it."""
        return list(self._encode(texts, opts, offsets))

    def encode_ids(
        self, id_lists: list[np.ndarray], opts: EmbedOptions, readout: bool = True
    ) -> tuple[list[list[int]], list[int]]:
        """Token ids a client sent (parameter token_ids), checked against the vocabulary. Ids
        the model reads a vector out of (`readout`; not the decode view) must begin and end
        with the special tokens its tokenizer puts around every text (Qwen3-Embedding's closing
        <|endoftext|>): ids of another tokenizer (tiktoken's, which LangChain's
        OpenAIEmbeddings sends) hold none, and would be read as this vocabulary's tokens. Past
        max_input_tokens they are cut or refused as texts are, those special tokens kept."""
        vocab = self._tok.get_vocab_size(with_added_tokens=True)
        head, tail = len(self._head), len(self._tail)
        out = []
        for i, ids in enumerate(id_lists):
            bad = np.flatnonzero((ids < 0) | (ids >= vocab))
            if bad.size:
                raise RequestError(
                    f"input 'TEXT[{i}]' holds token id {int(ids[bad[0]])} at {int(bad[0])}, "
                    f"outside this model's vocabulary 0..{vocab - 1}"
                )
            if not readout:
                out.append(ids[self._cut(i, len(ids), self._limit(opts), opts)].tolist())
                continue
            ends = ids[:head].tolist(), ids[len(ids) - tail :].tolist()
            if len(ids) < head + tail or ends != (self._head, self._tail):
                raise RequestError(self._foreign_ids(i))
            own = ids[head : len(ids) - tail]
            kept = own[self._cut(i, len(own), self._limit(opts) - head - tail, opts)]
            out.append(self._head + kept.tolist() + self._tail)
        return out, [len(ids) for ids in id_lists]

    def _foreign_ids(self, index: int) -> str:
        def named(ids: list[int]) -> str:
            return f"{ids} ({' '.join(map(self._tok.id_to_token, ids))})"

        where = [f"begin with {named(self._head)}"] if self._head else []
        where += [f"end with {named(self._tail)}"] if self._tail else []
        return (
            f"input 'TEXT[{index}]' token ids must {' and '.join(where)}, as this model's "
            "tokenizer writes every text: ids of another tokenizer mean nothing to this model "
            "(LangChain's OpenAIEmbeddings sends tiktoken's unless "
            "check_embedding_ctx_length=False); send texts, or this tokenizer's ids"
        )

    def _limit(self, opts: EmbedOptions) -> int:
        """Tokens per text for this request: the deployment's, or fewer (max_tokens)."""
        return min(self.max_input_tokens, opts.max_tokens or self.max_input_tokens)

    def _cut(
        self, index: int, n: int, budget: int, opts: EmbedOptions, limit: int | None = None
    ) -> slice:
        """The tokens kept of `n` under `budget` (the request's `limit`, less the special
        tokens it must keep), or RequestError when truncation is off."""
        if n <= budget:
            return slice(None)
        limit = limit or self._limit(opts)
        if not opts.truncate:
            raise RequestError(
                f"input 'TEXT[{index}]' has {n + limit - budget} tokens, more than "
                f"the limit of {limit} (send truncate=true to cut it)"
            )
        direction = opts.truncation_direction or self.truncation_direction
        return slice(None, budget) if direction == "right" else slice(n - budget, None)

    def tokens(self, encoded: list[Encoded]) -> list[list[dict]]:
        """Each encoded text's tokens as the encoder receives them, in TEI's /tokenize shape:
        id, text, special, and the token's UTF-8 byte offsets [start, stop) in the prompted
        text (null for special tokens, whose text is the token itself)."""
        out = []
        for e in encoded:
            if e.own_offsets is None:
                raise ValueError("tokens() needs texts encoded with offsets")
            spans = [None] * len(self._head) + e.encoding.offsets[e.cut] + [None] * len(self._tail)
            expansion = [None] * (len(e.ids) - len(spans))  # a query's (late_interaction.py)
            spans = expansion + spans if e.expanded_before else spans + expansion
            text = e.prompted.encode()
            byte_at = np.cumsum([0] + [len(c.encode()) for c in e.prompted])
            items = []
            for token_id, span in zip(e.ids, spans, strict=True):
                if token_id in self._special or span is None:
                    items.append(_token_entry(token_id, self._tok.id_to_token(token_id)))
                    continue
                start, stop = int(byte_at[span[0]]), int(byte_at[span[1]])
                piece = text[start:stop].decode("utf-8", errors="replace")
                items.append(_token_entry(token_id, piece, start, stop))
            out.append(items)
        return out

    def decode(self, id_lists: list[list[int]]) -> list[tuple[str, str]]:
        """Each id list as text: (special tokens skipped, special tokens kept)."""
        return [
            (self._tok.decode(ids, skip_special_tokens=True), self._tok.decode(ids, False))
            for ids in id_lists
        ]

    def encode_chunks(
        self, texts: list[str], opts: EmbedOptions
    ) -> tuple[list[list[int]], list[TextChunks], list[int]]:
        """Ids and input token counts as `encode_counted`, and each text's chunks: `chunk_size`
        tokens of the text at a time, the `chunk_spans` of its tokens (counted from its first
        token, after any prompt), the tokens that begin in each of its `chunk_chars`
        (character spans of the text), or with `chunk_by_separator` its tokens between the
        separators (the separators in no chunk)."""
        if opts.chunk_by_separator and self.separator is None:
            raise RequestError(
                "parameter 'chunk_by_separator' needs a model whose recipe joins a document's "
                "chunks by a separator (pplx-embed-context), and this one has none: send "
                "chunk_chars spans of the chunks"
            )
        if opts.chunk_by_separator:  # cut texts are refused below, saying why
            opts = dataclasses.replace(opts, truncate=True)
        all_ids, chunks, counts = [], [], []
        for i, e in enumerate(self._encode(texts, opts, offsets=True)):
            offsets = e.own_offsets
            n = len(offsets)
            if opts.chunk_by_separator:
                spans = self._separated(i, e, n, self._limit(opts))
            elif opts.chunk_size is not None:
                starts = np.arange(0, n, opts.chunk_size)
                spans = np.stack([starts, np.minimum(starts + opts.chunk_size, n)], axis=1)
                if len(spans) > MAX_CHUNKS:
                    raise RequestError(
                        f"parameter 'chunk_size' = {opts.chunk_size} cuts input 'TEXT[{i}]' "
                        f"({n} tokens) into {len(spans)} chunks, more than the limit of "
                        f"{MAX_CHUNKS}"
                    )
            elif opts.chunk_chars is not None:
                spans = self._char_chunks(i, offsets, opts.chunk_chars, len(texts[i]))
            else:
                spans = _within("chunk_spans", opts.chunk_spans, n, f"tokens of input 'TEXT[{i}]'")
            chars = np.array([(offsets[a][0], offsets[b - 1][1]) for a, b in spans], dtype=np.int32)
            all_ids.append(e.ids)
            chunks.append(TextChunks(spans + e.first, chars, len(self._tail)))
            counts.append(e.input_tokens)
        return all_ids, chunks, counts

    def _separated(self, index: int, e: Encoded, n: int, limit: int) -> np.ndarray:
        """Token spans of the chunks between the separators among a text's `n` own tokens
        (pplx-embed-context's recipe splits all of a text's ids; its tokenizer adds no special
        tokens, so those are its own). A text past the `limit` is refused, not cut: its chunks
        are embedded together, and a cut would drop chunks."""
        if e.input_tokens > len(e.ids):
            raise RequestError(
                f"input 'TEXT[{index}]' has {e.input_tokens} tokens, more than the limit of "
                f"{limit}: its chunks are read as one text (send fewer or shorter chunks)"
            )
        own = np.asarray(e.ids[e.first : e.first + n])
        at = np.flatnonzero(own == self._separator_id)
        spans = np.stack([np.concatenate([[0], at + 1]), np.concatenate([at, [n]])], axis=1)
        empty = np.flatnonzero(spans[:, 0] == spans[:, 1])
        if empty.size:
            raise RequestError(
                f"input 'TEXT[{index}]' chunk {int(empty[0])} holds no tokens between the "
                f"separators ({self.separator!r})"
            )
        if len(spans) > MAX_CHUNKS:
            raise RequestError(
                f"input 'TEXT[{index}]' holds {len(spans)} chunks, more than the limit of "
                f"{MAX_CHUNKS}"
            )
        return spans

    @staticmethod
    def _char_chunks(index: int, offsets: list, chars, size: int) -> np.ndarray:
        """Token spans of the text's own tokens that begin in each [start, end) of `chars`
        (a token straddling the prompt's end begins at 0); `size`: the text's characters."""
        chars = _within("chunk_chars", chars, size, f"characters of input 'TEXT[{index}]'")
        starts = np.array([a for a, _ in offsets], dtype=np.int64)
        spans = np.searchsorted(starts, chars, side="left")
        empty = np.flatnonzero(spans[:, 0] == spans[:, 1])
        if empty.size:
            j = int(empty[0])
            raise RequestError(
                f"parameter 'chunk_chars'[{j}] = {list(chars[j])} holds the start of no token "
                f"of input 'TEXT[{index}]'"
            )
        return spans

    def encode_media(
        self, texts: list[str], visuals: list[str], opts: EmbedOptions, fields: list[str]
    ) -> tuple[list[list[int]], list[int]]:
        """Ids and input token counts of texts written in the checkpoint's chat template after
        their videos' and images' placeholders (`visuals`: per text, the placeholder text;
        `fields`: the input a refusal names); a text too long loses its own tokens only (the
        template and its visuals stay whole). One tokenization per text unless it must be cut."""
        if self.chat is None:
            raise RequestError("input 'IMAGES' holds images, and this model reads text only")
        if opts.instruction is not None and not self.chat.takes_instruction:
            way = (
                "its tasks' prompts are its system turns (prompt_name 'query' or 'document')"
                if self.late is not None
                else "its processor writes queries and documents its own way"
            )
            raise RequestError(
                f"parameter 'instruction' is not read by this model: {way}; send parameter "
                "'prompt' to prefix the text"
            )
        named = opts.prompt_name
        if named is None and opts.instruction is None:
            named = self.prompts.default_name
        if self.chat.prompted:  # the prompt before a text alone, as any text's
            instruction = self.prompts.resolve(opts.prompt_name, None, opts.prompt)
        elif named is not None:  # as sentence-transformers writes a prompt: the system turn
            instruction = self.prompts.prompts[named]
        elif self.chat.takes_instruction:
            instruction = self.chat.system(opts.instruction)
        else:
            instruction = ""
        extra, limit = len(self._head) + len(self._tail), self._limit(opts)
        out, counts = [], []
        for i, (text, visual) in enumerate(zip(texts, visuals, strict=True)):
            try:
                before, text, after = self.chat.parts(
                    instruction, visual, fields[i] == "VIDEOS", text
                )
            except RequestError as e:  # what the template refuses of this text
                raise RequestError(f"input 'TEXT[{i}]' {e}") from None
            before += "" if self.chat.prompted else opts.prompt or ""
            ids = self._tok.encode(before + text + after, add_special_tokens=False).ids
            count = len(ids) + extra
            if count > limit:
                # the template's and the visuals' tokens, kept whole where the text is cut
                fixed = len(self._tok.encode(before + after, add_special_tokens=False).ids)
                fixed += extra
                if fixed > limit:
                    hint = f"; {FEWER_FRAMES}" if fields[i] == "VIDEOS" else ""
                    raise RequestError(
                        f"input '{fields[i]}[{i}]' takes {fixed} tokens with the template, "
                        f"more than the limit of {limit}{hint}"
                    )
                own = self._tok.encode(text, add_special_tokens=False)
                kept = own.offsets[self._cut(i, len(own.ids), limit - fixed, opts)]
                text = text[kept[0][0] : kept[-1][1]] if kept else ""
                ids = self._tok.encode(before + text + after, add_special_tokens=False).ids
                count = fixed + len(own.ids)
            out.append(self._head + ids + self._tail)
            counts.append(count)
        return out, counts

    def _encode(self, texts: list[str], opts: EmbedOptions, offsets: bool):
        """Per text, its Encoded; with `offsets` (the `tokens` view and late chunking: they
        cost a Python tuple per token) also its tokens' character spans, the index of its first
        own token among the ids (past the special tokens and prompt before it) and its own
        tokens' character spans in the text. Without, the tokenizer skips them altogether."""
        prefix = self.prompts.resolve(opts.prompt_name, opts.instruction, opts.prompt)
        if prefix:
            texts = [prefix + t for t in texts]
        skip = len(prefix or "")
        extra = len(self._head) + len(self._tail)
        limit, task = self._limit(opts), None
        if self.late is not None:  # a MultiVectorEncoder's task: its lengths, its expansion
            task = self._task(opts)
            limit = min(limit, self.late.limit(task) or limit)
        encode = self._tok.encode_batch if offsets else self._tok.encode_batch_fast
        for i, enc in enumerate(encode(texts, add_special_tokens=False)):
            ids = enc.ids
            if not ids:
                raise RequestError(f"input 'TEXT[{i}]' produced no tokens")
            cut = self._cut(i, len(ids), limit - extra, opts, limit)
            kept, before = self._head + ids[cut] + self._tail, 0
            if task is not None:
                kept, before = self.late.expanded(kept, task)
            done = Encoded(kept, len(ids) + extra, texts[i], enc, cut, before)
            if offsets:
                spans = enc.offsets[cut]
                # A token that straddles the prompt's end counts as the text's.
                first = next((j for j, (_, end) in enumerate(spans) if end > skip), len(spans))
                done.first = before + len(self._head) + first
                done.own_offsets = [(max(a - skip, 0), b - skip) for a, b in spans[first:]]
            yield done


def _within(name: str, spans, size: int, of: str) -> np.ndarray:
    """A late-chunking parameter's [start, end) spans as an array, each within `size` (`of`:
    what is counted, for the refusal)."""
    spans = np.array(spans, dtype=np.int64)
    past = np.flatnonzero(spans[:, 1] > size)
    if past.size:
        j = int(past[0])
        raise RequestError(f"parameter '{name}'[{j}] = {list(spans[j])} goes past the {size} {of}")
    return spans


def ids_and_counts(encoded: list[Encoded]) -> tuple[list[list[int]], list[int]]:
    """(ids per text, tokens per text before truncation), as `encode_counted` gives them."""
    return [e.ids for e in encoded], [e.input_tokens for e in encoded]


@dataclass
class Encoded:
    ids: list[int]  # what the encoder receives
    input_tokens: int  # before truncation, special tokens included
    prompted: str  # the text with its prompt, as tokenized
    encoding: object  # tokenizers.Encoding of `prompted`, without special tokens; its
    # offsets are zeros unless encoded with offsets
    cut: slice  # the tokens of `encoding` kept
    expanded_before: int = 0  # a query's expansion tokens before its own (late_interaction.py)
    first: int = 0
    own_offsets: list | None = None


def _token_entry(token_id: int, text: str, start: int | None = None, stop: int | None = None):
    return {"id": token_id, "text": text, "special": start is None, "start": start, "stop": stop}
