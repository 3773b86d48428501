"""Text -> token ids for one request: prompts, the input limit and truncation."""

from __future__ import annotations

from pathlib import Path

from .requests import RequestError, RequestOptions


class TextTokenizer:
    def __init__(self, model_dir: str | Path, max_input_tokens: int):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self._tok.no_truncation()
        self._tok.no_padding()
        self.max_input_tokens = max_input_tokens
        # Qwen3-Embedding's post-processor appends <|endoftext|>; truncation must keep it,
        # because last-token pooling reads it.
        self._keeps_last = (
            self._tok.encode("a").ids[-1] != self._tok.encode("a", add_special_tokens=False).ids[-1]
        )

    def encode(self, texts: list[str], opts: RequestOptions) -> list[list[int]]:
        prompt = opts.prompt()
        if prompt is not None:
            texts = [prompt + t for t in texts]
        limit = self.max_input_tokens
        out = []
        for i, enc in enumerate(self._tok.encode_batch(texts)):
            ids = enc.ids
            if not ids:
                raise RequestError(f"input 'TEXT[{i}]' produced no tokens")
            if len(ids) > limit:
                if not opts.truncate:
                    raise RequestError(
                        f"input 'TEXT[{i}]' has {len(ids)} tokens, more than the limit of "
                        f"{limit} (send truncate=true to cut it)"
                    )
                ids = ids[: limit - 1] + ids[-1:] if self._keeps_last else ids[:limit]
            out.append(ids)
        return out
