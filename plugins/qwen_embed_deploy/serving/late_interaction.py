"""A sentence-transformers MultiVectorEncoder's texts (ColBERT-style late interaction over a
Qwen2/Qwen3 backbone), as its Transformer module writes them (`sentence_bert_config.json`).
Over a multimodal backbone (Qwen3-VL-Embedding: modality 'message') its texts and images are
written in the backbone's chat template, the task's prompt its system turn (tokenizer.py), and
it saves no lengths or expansion.

A request's task is the prompt it names: `query` is `encode_query`'s, `document`
`encode_document`'s (both names are served, with an empty prompt where the checkpoint saves
none); a request naming neither is `encode`'s, without a task.
- `query_length` and `document_length` cut a query's and a document's tokens (special tokens
  kept), as the tokenizer's truncation does;
- `query_expansion` writes every query as `length` tokens at least: the text, then its
  expansion token (`token`, else the tokenizer's mask token, else its EOS) in the places
  padding would take. "fixed" also cuts a longer query to `length` and pads on the
  tokenizer's padding side (Qwen's is the left: the expansion comes first); "min" leaves a
  longer query whole and pads one query alone at its end. The encoder attends to the
  expansion tokens and scores them; a checkpoint whose encoder must not attend to them
  (`attend` false, classic ColBERT's attention mask) is refused;
- its MultiVectorMask's skiplist leaves tokens out of the vectors of the texts of its
  `skiplist_tasks` (documents, and texts without a task, by default): the encoder drops them
  (FINISH's `skiplist`) and says how many are left (TOKEN_ROWS).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qwen_embed.config import ModelConfig
from qwen_embed.loader import read_json
from qwen_embed.sentence_modules import MULTI_VECTOR_MASK, module_kinds


def is_late_interaction(model_dir: str | Path) -> bool:
    """Whether the checkpoint is a sentence-transformers MultiVectorEncoder (modules.json
    lists a MultiVectorMask)."""
    return MULTI_VECTOR_MASK in module_kinds(model_dir)


@dataclass(frozen=True)
class LateInteraction:
    query_length: int | None
    document_length: int | None
    expansion_length: int | None  # None: no query expansion
    fixed: bool  # "fixed": cut to expansion_length as well
    expansion_id: int | None
    expand_before: bool  # "fixed" on a left-padding tokenizer
    skiplist_tasks: tuple[str, ...] = ()  # where its skiplist applies (none without one)

    @classmethod
    def from_dir(cls, model_dir: str | Path, tok) -> LateInteraction | None:
        """Its reading of texts (`tok`: its tokenizers.Tokenizer), None for another model."""
        model_dir = Path(model_dir)
        if not is_late_interaction(model_dir):
            return None
        config = read_json(model_dir / "sentence_bert_config.json", {})
        where = model_dir / "sentence_bert_config.json"
        expansion = config.get("query_expansion")
        lengths = config.get("query_length"), config.get("document_length")
        model = ModelConfig.from_dir(model_dir)
        if "message" in (config.get("modality_config") or {}):
            if model.media is None:
                raise ValueError(
                    f"{where}: texts written through its chat template (modality 'message') "
                    "are served for a multimodal backbone (Qwen3-VL), and this one reads text"
                )
            if expansion is not None or any(n is not None for n in lengths):
                raise ValueError(
                    f"{where}: query_expansion, query_length and document_length would cut or "
                    "pad its texts as its chat template writes them, which is not supported"
                )
        skips = model.sentence.skiplist_tasks if model.sentence.skiplist else ()
        if expansion is None:
            return cls(*lengths, None, False, None, False, skips)
        if not expansion.get("attend", False):
            raise ValueError(
                f"{where}: query_expansion with attend false (expansion tokens the encoder "
                "does not attend to) is not supported; attend true is"
            )
        if expansion.get("strategy") not in ("fixed", "min"):
            raise ValueError(f"{where}: query_expansion strategy must be 'fixed' or 'min'")
        from .tokenizer import token_text  # that module reads checkpoints through this one

        tokenizer_config = read_json(model_dir / "tokenizer_config.json", {})
        name = expansion.get("token")
        for fallback in ("mask_token", "eos_token"):
            if name is None:
                name = token_text(tokenizer_config.get(fallback))
        token_id = None if name is None else tok.token_to_id(name)
        if token_id is None:
            raise ValueError(
                f"{where}: query_expansion's token {name!r} is not in the tokenizer (set "
                "'token', or give the tokenizer a mask or EOS token)"
            )
        fixed = expansion["strategy"] == "fixed"
        before = fixed and tokenizer_config.get("padding_side", "right") == "left"
        return cls(*lengths, expansion["length"], fixed, token_id, before, skips)

    @staticmethod
    def task(prompt_name: str | None) -> str | None:
        """The MultiVectorEncoder task a request's (resolved) prompt name stands for."""
        return prompt_name if prompt_name in ("query", "document") else None

    def skips(self, task: str | None) -> bool:
        """Whether its skiplist leaves tokens out of a text of `task` (None counts as a
        document, as sentence-transformers counts it)."""
        return (task or "document") in self.skiplist_tasks

    def limit(self, task: str | None) -> int | None:
        """The most tokens a text of `task` keeps (special tokens included); None: the
        deployment's limit alone."""
        if task == "query":
            if self.expansion_length is not None and self.fixed:
                return self.expansion_length
            return self.query_length
        return self.document_length if task == "document" else None

    def expanded(self, ids: list[int], task: str | None) -> tuple[list[int], int]:
        """A query's ids with its expansion, and how many expansion tokens come before them."""
        if task != "query" or self.expansion_length is None:
            return ids, 0
        pad = [self.expansion_id] * max(self.expansion_length - len(ids), 0)
        return (pad + ids, len(pad)) if self.expand_before else (ids + pad, 0)
