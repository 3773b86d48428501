"""Task heads beside pooling: what a forward's last-token hidden states turn into.

`embed` pools and normalises (pooling.py). `rerank` scores a (query, document) sequence:
- a causal-LM reranker (Qwen3-Reranker) reads two rows of its output head, "yes" and "no", at the
  last token; score = softmax over that pair = sigmoid(logit_yes - logit_no). Only those two rows
  are loaded (from `lm_head.weight`, or `embed_tokens.weight` when the embeddings are tied): the
  151k-row head is never built.
- a converted sequence-classification checkpoint has a one-row `score` head; score =
  sigmoid(logit).
The rows are tiny (2 x hidden), so rank 0 holds them whole and applies them to the final hidden
states, which every rank has in full.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig

# Qwen3-Reranker's answer tokens: the model is asked for "yes" or "no".
ANSWER_TOKENS = ("yes", "no")


def resolve_task(task: str, config: ModelConfig) -> str:
    """`auto` is rerank for sequence-classification checkpoints, else embed. A causal LM can be
    either (the architecture cannot tell an embedder from a reranker): the deployment says
    (settings.TASKS)."""
    if task == "auto":
        return "rerank" if config.is_classifier else "embed"
    return task


def answer_token_ids(model_dir: str | Path) -> list[int]:
    """The vocabulary ids of "yes" and "no" from the checkpoint's own tokenizer."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"a reranker needs {path} to find the 'yes'/'no' token ids")
    tok = Tokenizer.from_file(str(path))
    ids = [tok.token_to_id(t) for t in ANSWER_TOKENS]
    if None in ids:
        raise ValueError(f"{path} has no single tokens {ANSWER_TOKENS}: not a Qwen3-Reranker")
    return ids


class ScoreHead(nn.Module):
    """Selected rows of an output head -> one relevance score in [0, 1] per sequence."""

    def __init__(self, hidden_size: int, checkpoint_name: str, rows: list[int] | None):
        super().__init__()
        self.rows = rows  # vocabulary rows to keep (None: the whole tensor, a `score` head)
        count = len(rows) if rows is not None else 1
        # float32 whatever the model's dtype: two rows cost nothing and scores stay precise.
        self.weight = nn.Parameter(
            torch.empty(count, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.weight.checkpoint_name = checkpoint_name
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        picked = full[self.rows] if self.rows is not None else full
        if picked.shape != param.shape:
            raise ValueError(
                f"head rows have shape {tuple(picked.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(picked.to(param.dtype))

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        logits = last_hidden.float() @ self.weight.t()
        if logits.shape[1] == 2:  # yes, no
            logits = logits[:, 0] - logits[:, 1]
        return torch.sigmoid(logits.reshape(-1))


def build_score_head(config: ModelConfig, model_dir: str | Path) -> ScoreHead:
    if config.is_classifier:
        if config.num_labels != 1:
            raise ValueError(
                f"a reranking classifier has one label, this one has {config.num_labels}"
            )
        return ScoreHead(config.hidden_size, "score.weight", None)
    name = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    return ScoreHead(config.hidden_size, name, answer_token_ids(model_dir))
