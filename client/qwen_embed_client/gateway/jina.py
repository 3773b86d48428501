"""Jina AI's embeddings fields, which its clients send to /v1/embeddings (openai.py's body takes
them): `task` picks the checkpoint's prompt (TASK_PROMPTS) or a task for its query prompt
(TASK_INSTRUCTIONS_BY_TASK), and on a checkpoint with task adapters (jina-embeddings-v5) it
must name the adapter the deployment merged (task_options); `normalized` is `normalize`,
`embedding_type` (or `encoding_type`) "base64" a float vector in base64 (openai.py's kinds);
`late_chunking` embeds the inputs as one text (their concatenation, a space between two), one
vector per input, each computed in the context of the others (late_chunk_embeddings: the
server's late chunking, docs/api.md); on a model with a chunk separator (pplx-embed-context)
the inputs are one document's chunks, joined by it as the model's recipe joins them."""

from __future__ import annotations

import re

import numpy as np
from pydantic_core import PydanticCustomError

from ..client import EmbeddingError
from ..contract import MAX_CHUNKS
from .common import TASK_INSTRUCTIONS, Encoding, prompt_options
from .errors import backend_error, chunk_refusal, invalid

# Jina's tasks: a retrieval side takes the checkpoint's query or document prompt (by name),
# a symmetric task the query prompt with that task as its instruction.
TASK_PROMPTS = {
    "retrieval.query": "query",
    "retrieval.passage": "document",
    "code.query": "query",
    "code.passage": "document",
}
TASK_INSTRUCTIONS_BY_TASK = {
    "text-matching": TASK_INSTRUCTIONS["similarity"],
    "classification": TASK_INSTRUCTIONS["classification"],
    "separation": TASK_INSTRUCTIONS["clustering"],
}
TASKS = (*TASK_PROMPTS, *TASK_INSTRUCTIONS_BY_TASK)
# jina-embeddings-v5's adapter for each task (its adapters/ folders)
TASK_ADAPTERS = {
    "retrieval.query": "retrieval",
    "retrieval.passage": "retrieval",
    "code.query": "code",
    "code.passage": "code",
    "text-matching": "text-matching",
    "classification": "classification",
    "separation": "clustering",
}
# A task NAME.query or NAME.passage also names the checkpoint's own prompt NAME_query or
# NAME_document, where it has one (jina-code-embeddings' nl2code, qa, code2code, ...).
NAMED_TASK = re.compile(r"^([a-z0-9_]+)\.(query|passage)$")
SIDES = {"query": "query", "passage": "document"}
SEPARATOR = " "  # between two inputs in the text late chunking reads

_TOO_LONG = re.compile(r"has (\d+) tokens, more than the limit of (\d+)")


def checked_task(task: str) -> str:
    """A body's `task`: one of Jina's TASKS, or NAME.query / NAME.passage."""
    if task not in TASKS and not NAMED_TASK.match(task):
        raise PydanticCustomError(
            "task",
            "must be one of {tasks}, or NAME.query / NAME.passage for a checkpoint's prompts "
            "NAME_query / NAME_document",
            {"tasks": list(TASKS)},
        )
    return task


def is_passage_task(task: str) -> bool:
    return task.endswith(".passage")


def task_options(task: str, prompt_names: list[str], route: dict) -> dict:
    """The request options of a Jina `task` for the served checkpoint (`route`: the encoder's
    route fact): the checkpoint's own prompt the task names (NAMED_TASK) where it has it; else
    a task of Jina's: on a checkpoint with Jina's task adapters, its adapter where the encoder
    keeps it per request (lora_modules), else the one merged at load (a task of another adapter
    is refused; a symmetric task takes the checkpoint's default prompt: its adapter is the
    task), elsewhere a prompt by name or an instruction."""
    named = NAMED_TASK.match(task)
    own = named and f"{named[1]}_{SIDES[named[2]]}"
    if own in prompt_names:
        return {"prompt_name": own}
    if task not in TASKS:
        raise invalid(
            f"task '{task}' names the prompt '{own}', which this checkpoint lacks (its "
            f"prompts: {prompt_names})",
            "task",
        )
    if TASK_ADAPTERS[task] in route.get("lora_names", ()):
        return prompt_options(task, prompt_names, TASK_PROMPTS) | {"adapter": TASK_ADAPTERS[task]}
    adapter = route.get("adapter")
    if adapter not in TASK_ADAPTERS.values():  # none, or a fine-tune's (no task of Jina's)
        return prompt_options(task, prompt_names, TASK_PROMPTS, TASK_INSTRUCTIONS_BY_TASK)
    if TASK_ADAPTERS[task] != adapter:
        raise invalid(
            f"task '{task}' takes the checkpoint's '{TASK_ADAPTERS[task]}' adapter, and this "
            f"deployment merged '{adapter}' (the encoder's parameter adapter)",
            "task",
        )
    return prompt_options(task, prompt_names, TASK_PROMPTS)


def input_spans(texts: list[str]) -> list[list[int]]:
    """Each text's [start, end) characters in their joined text, from the previous text's end:
    the separator before a text is the text's."""
    ends = np.cumsum([len(t) + len(SEPARATOR) for t in texts]) - len(SEPARATOR)
    return np.stack([np.concatenate([[0], ends[:-1]]), ends], axis=1).tolist()


async def late_chunk_embeddings(gw, texts: list[str], options: dict, encoding: Encoding):
    """(one vector per text, the tokens of their joined text): the texts read as one, each
    text a chunk of it, given to the server as character spans (a token that begins in the
    separator before a text is that text's), or on a model with a chunk separator as one
    document of contextual chunks; the joined text must fit the model's limit."""
    if len(texts) > MAX_CHUNKS:
        raise invalid(
            f"'late_chunking' takes at most {MAX_CHUNKS} inputs, got {len(texts)}", "input"
        )
    contextual = "chunk_separator" in await gw.client.served_facts()
    try:
        if contextual:  # the model's own recipe: its separator between the inputs
            (result,) = await gw.client.embed_contextual([texts], **options, headers=gw.outgoing())
        else:
            (result,) = await gw.client.embed_chunks(
                [SEPARATOR.join(texts)],
                char_spans=input_spans(texts),
                **{**options, "truncate": False},  # the joined text whole, or refused
                headers=gw.outgoing(),
            )
    except ValueError as e:  # an input holding the separator (client.joined_documents)
        raise chunk_refusal(e, "documents[0]") from e
    except EmbeddingError as e:
        too_long = _TOO_LONG.search(str(e))
        if too_long is None:
            raise backend_error(e, ("dimensions",), "input") from e
        raise invalid(
            f"'late_chunking' reads the {len(texts)} inputs as one text of {too_long[1]} "
            f"tokens, more than the limit of {too_long[2]}: send fewer or shorter inputs",
            "input",
        ) from e
    return [encoding(v) for v in result.embeddings], result.token_count
