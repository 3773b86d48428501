"""The prompts a checkpoint defines, as sentence-transformers reads them.

`config_sentence_transformers.json` names prompts (`{"prompts": {"query": "...", ...},
"default_prompt_name": ...}`); sentence-transformers prepends the chosen one to every text, and so
do we. A sentence-transformers checkpoint without that file (a `modules.json` alone, as
pplx-embed ships) has no prompts; a bare transformers checkpoint gets Qwen3-Embedding's.
`instruction` fills the task slot of the model's own query prompt (`Instruct: {task}\\nQuery:`
plus whatever the model puts after it); a raw `prompt` is a literal prefix for everything else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from qwen_embed_client.contract import DEFAULT_TASK, RequestError

SENTENCE_TRANSFORMERS_CONFIG = "config_sentence_transformers.json"
QWEN3_EMBEDDING_PROMPTS = {"query": f"Instruct: {DEFAULT_TASK}\nQuery:", "document": ""}
# Qwen3-Embedding's and gte-Qwen2's query prompts: a task between "Instruct: " and "\nQuery:".
_TASK_SLOT = re.compile(r"^Instruct: (?P<task>.*)\nQuery:(?P<tail>[ \t]*)$", re.S)


@dataclass(frozen=True)
class PromptSet:
    prompts: dict[str, str]
    default_name: str | None
    source: str  # where they came from, for messages and `qwen-embed info`

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> PromptSet:
        path = Path(model_dir) / SENTENCE_TRANSFORMERS_CONFIG
        if not path.is_file():
            if (Path(model_dir) / "modules.json").is_file():
                return cls({}, None, f"{model_dir} (a sentence-transformers model without prompts)")
            return cls(dict(QWEN3_EMBEDDING_PROMPTS), None, "Qwen3-Embedding's prompts")
        config = json.loads(path.read_text())
        prompts = config.get("prompts") or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
            raise ValueError(f"{path}: 'prompts' must map names to strings")
        default = config.get("default_prompt_name")
        if default is not None and default not in prompts:
            raise ValueError(f"{path}: default_prompt_name {default!r} is not in its prompts")
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
