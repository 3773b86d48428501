"""Task heads beside pooling: what a forward's pooled hidden states turn into.

`embed` pools (batch.py), then applies the checkpoint's own projections where it has any
(sentence_modules.py: a top-level `linear`, sentence-transformers' Dense modules), then
truncates and normalises per request. `rerank` scores a (query, document) sequence:
- a causal-LM reranker reads two rows of its output head, its answer tokens (Qwen3-Reranker's
  "yes" and "no", mxbai-rerank-v2's "1" and "0", or those its sentence-transformers LogitScore
  names), at the last token; score = softmax over that pair = sigmoid(logit_yes - logit_no),
  or sigmoid(logit) of a LogitScore's one row. Only those rows are loaded (from
  `lm_head.weight`, or `embed_tokens.weight` when the embeddings are tied): the 151k-row head
  is never built.
- a converted sequence-classification checkpoint has a one-row `score` head; score =
  sigmoid(logit).
  A CrossEncoder whose `activation_fn` is none scores the logit itself (score_kind "logit").
- jina-reranker-m0 has a `score` MLP (Linear, ReLU, Linear, with biases) over the last token
  (its pairs end in a score token); score = sigmoid(logit - 2.65), its compute_score's.
- a listwise reranker (jina-reranker-v3) reads a query and a block of documents in one sequence:
  its projector maps the final hidden states at marker tokens (one after each document, one
  after the query) to vectors, and a document's score is the cosine of its vector with the
  query's, merged across blocks as its own `rerank` does (`listwise_scores`).
`classify` (a sequence classifier of several labels) answers the logits of its `score` head.
Heads are small (2 x hidden for a reranker, a few million weights for a projection), so rank 0
holds them whole, in fp32, and applies them to the final hidden states, which every rank has
in full.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import LISTWISE_MARKERS, ModelConfig
from .loader import safetensors_file
from .sentence_modules import Dense

# A causal-LM reranker's answer tokens (relevant, not relevant), by family: Qwen3-Reranker and
# Qwen3-VL-Reranker are asked for "yes" or "no"; mxbai-rerank-v2, the published Qwen2 reranker,
# for "1" or "0". The pair templates follow the same families (serving/rerank.pair_template).
ANSWER_TOKENS = {"qwen3": ("yes", "no"), "qwen3_5": ("yes", "no"), "qwen2": ("1", "0")}


def resolve_task(task: str, config: ModelConfig) -> str:
    """`auto` is rerank for a sequence-classification checkpoint of one label (a converted
    cross-encoder) and for a listwise reranker, classify for a classifier of several labels,
    else embed. A causal LM can be an embedder or a reranker (the architecture cannot tell):
    the deployment says (settings.TASKS), unless a sentence-transformers CrossEncoder's
    LogitScore says it reranks."""
    if task == "auto":
        if config.is_classifier:
            return "rerank" if config.num_labels == 1 else "classify"
        reranks = config.listwise or config.mlp_score or config.sentence.logit_score is not None
        return "rerank" if reranks else "embed"
    if config.multi_vector and task != "embed":
        raise ValueError(f"task {task!r}: a multi-vector retriever only embeds")
    if config.listwise and task != "rerank":
        raise ValueError(f"task {task!r}: a listwise reranker (JinaForRanking) only reranks")
    if task == "classify" and not (config.is_classifier and config.num_labels > 1):
        raise ValueError(
            "task 'classify' needs a sequence-classification checkpoint with several labels "
            f"(id2label); this one has {config.num_labels}"
        )
    return task


def token_ids(model_dir: str | Path, tokens: tuple[str, ...], what: str) -> list[int]:
    """The vocabulary ids of single tokens from the checkpoint's own tokenizer."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"a reranker needs {path} to find the ids of {tokens}")
    tok = Tokenizer.from_file(str(path))
    ids = [tok.token_to_id(t) for t in tokens]
    if None in ids:
        raise ValueError(f"{path} has no single tokens {tokens}: not {what}")
    return ids


class ScoreHead(nn.Module):
    """Selected rows of an output head -> one relevance score per sequence: P(relevant) in
    [0, 1], or with `probability` false its logit."""

    def __init__(
        self,
        hidden_size: int,
        checkpoint_name: str,
        rows: list[int] | None,
        labels: int = 1,
        probability: bool = True,
    ):
        super().__init__()
        # `rows`: the vocabulary rows to keep (None: the whole tensor, a `score` head)
        count = len(rows) if rows is not None else labels
        self.weight = checkpoint_parameter(torch.empty(count, hidden_size), checkpoint_name, rows)
        self.probability = probability

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        logits = last_hidden.float() @ self.weight.t()
        if logits.shape[1] == 2:  # relevant, not relevant
            logits = logits[:, 0] - logits[:, 1]
        logits = logits.reshape(-1)
        return torch.sigmoid(logits) if self.probability else logits


class MlpScoreHead(nn.Module):
    """jina-reranker-m0's `score` MLP (`score.0`: hidden -> hidden, ReLU, `score.2`: hidden
    -> 1, with biases) in fp32 over the last token's hidden state -> P(relevant), the sigmoid
    of its logit less LOGIT_BIAS (its compute_score's normalisation)."""

    LOGIT_BIAS = 2.65

    def __init__(self, hidden_size: int):
        super().__init__()
        self.first = checkpoint_parameter(torch.empty(hidden_size, hidden_size), "score.0.weight")
        self.first_bias = checkpoint_parameter(torch.empty(hidden_size), "score.0.bias")
        self.second = checkpoint_parameter(torch.empty(1, hidden_size), "score.2.weight")
        self.second_bias = checkpoint_parameter(torch.empty(1), "score.2.bias")

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.linear(last_hidden.float(), self.first, self.first_bias))
        logits = F.linear(x, self.second, self.second_bias).reshape(-1)
        return torch.sigmoid(logits - self.LOGIT_BIAS)


class ListwiseHead(nn.Module):
    """jina-reranker-v3's projector (Linear, ReLU, Linear, no biases; `projector.0.weight`,
    `projector.2.weight`), in fp32, over the hidden states at its marker tokens.
    `document_id`, `query_id`: the markers' ids; `spans(ids)` the chunks (chunking.py) whose
    last tokens they are."""

    def __init__(self, hidden_size: int, model_dir: str | Path, width: int = 512):
        super().__init__()
        self.document_id, self.query_id = token_ids(
            model_dir, LISTWISE_MARKERS, "jina-reranker-v3's tokenizer"
        )
        # Its sizes, as its modeling code builds them: hidden / 2, then 512.
        self.first = checkpoint_parameter(
            torch.empty(hidden_size // 2, hidden_size), "projector.0.weight"
        )
        self.second = checkpoint_parameter(
            torch.empty(width, hidden_size // 2), "projector.2.weight"
        )

    @property
    def width(self) -> int:
        return self.second.shape[0]

    def spans(self, ids: np.ndarray) -> np.ndarray:
        """(start, end) token spans that end at each marker: the documents' in order, then
        the query's, which must be the one after them all (ValueError otherwise)."""
        documents = np.flatnonzero(ids == self.document_id)
        queries = np.flatnonzero(ids == self.query_id)
        if len(documents) == 0 or len(queries) != 1 or queries[0] < documents[-1]:
            raise ValueError(
                "a listwise block needs document markers followed by one query marker, got "
                f"{len(documents)} and {len(queries)}"
            )
        ends = np.append(documents, queries) + 1
        return np.stack([np.concatenate([[0], ends[:-1]]), ends], axis=1)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(states.float(), self.first)), self.second)


def checkpoint_parameter(
    tensor: torch.Tensor, checkpoint_name: str, rows: list[int] | None = None
) -> nn.Parameter:
    """A head parameter the checkpoint loader fills from `checkpoint_name` (its `rows` only,
    if given), in fp32 whatever the model's dtype: heads are small, and scores stay precise."""

    def load(param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        picked = full[rows] if rows is not None else full
        if picked.shape != param.shape:
            raise ValueError(
                f"head rows have shape {tuple(picked.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(picked.to(param.dtype))

    param = nn.Parameter(tensor.float(), requires_grad=False)
    param.checkpoint_name = checkpoint_name
    param.weight_loader = load
    return param


def listwise_scores(blocks: list[np.ndarray]) -> np.ndarray:
    """One query's blocks of projected vectors ([documents + 1, width], the query's last) ->
    every document's score, in order: the cosine of its vector with the query's, where the
    query's is the mean of its blocks' query vectors, each weighted by its block's best
    (1 + cosine) / 2 (jina-reranker-v3's `rerank`; one block: that block's cosines)."""

    def cosines(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
        norms = np.linalg.norm(query) * np.linalg.norm(documents, axis=1)
        return documents @ query / norms

    queries = np.stack([b[-1] for b in blocks])
    weights = [((1.0 + cosines(b[-1], b[:-1])) / 2.0).max() for b in blocks]
    query = np.average(queries, axis=0, weights=weights)
    return cosines(query, np.concatenate([b[:-1] for b in blocks])).astype(np.float32)


class ClassifierHead(ScoreHead):
    """A sequence classifier's `score` head: last-token hidden states -> logits [n, labels]
    (softmax or sigmoid is the caller's: TEI's raw_scores asks for the logits)."""

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return last_hidden.float() @ self.weight.t()


def build_score_head(config: ModelConfig, model_dir: str | Path) -> nn.Module:
    if config.listwise:
        return ListwiseHead(config.hidden_size, model_dir)
    if config.mlp_score:
        return MlpScoreHead(config.hidden_size)
    probability = config.score_kind == "probability"
    if config.is_classifier:
        if config.num_labels != 1:
            raise ValueError(
                f"a reranking classifier has one label, this one has {config.num_labels}"
            )
        return ScoreHead(config.hidden_size, "score.weight", None, probability=probability)
    name = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if config.sentence.logit_score is not None:
        rows = [i for i in config.sentence.logit_score if i is not None]
    else:
        rows = token_ids(model_dir, ANSWER_TOKENS[config.family], f"a {config.family} reranker's")
    return ScoreHead(config.hidden_size, name, rows, probability=probability)


ACTIVATION_FUNCTIONS = {
    "identity": nn.Identity(),
    "tanh": nn.Tanh(),
    "relu": nn.ReLU(),
    "gelu": nn.GELU(),
    "sigmoid": nn.Sigmoid(),
}


class ProjectionHead(nn.Module):
    """The checkpoint's dense projections of pooled vectors (or, for a multi-vector retriever,
    of every token's final hidden state), in order, in fp32, then its final activation
    (sentence_modules.SentenceModules). Its weights are buffers read here from their own
    files, not parameters for the checkpoint loader; a merged adapter's `deltas` (adapters.
    lora_deltas, by tensor name) are added to the weights they change, and adapters a request
    names (lora.attach) hold their pairs in `loras`, by projection."""

    def __init__(self, dense: tuple[Dense, ...], final_activation: str = "identity", deltas=None):
        super().__init__()
        deltas = deltas or {}
        self.weight_names = [d.prefix + "weight" for d in dense]  # the checkpoint's tensors
        self.loras: list = [None] * len(dense)  # lora.LinearLora of each projection, or None
        self.activations = [ACTIVATION_FUNCTIONS[d.activation] for d in dense]
        self.final = ACTIVATION_FUNCTIONS[final_activation]
        for i, d in enumerate(dense):
            with safetensors_file(Path(d.weights)) as f:
                shapes = {"weight": (d.out_features, d.in_features), "bias": (d.out_features,)}
                for part in ("weight", "bias") if d.bias else ("weight",):
                    tensor = f.get_tensor(d.prefix + part).float()
                    if d.prefix + part in deltas:
                        tensor = tensor + deltas[d.prefix + part]
                    if tuple(tensor.shape) != shapes[part]:
                        raise ValueError(
                            f"{d.weights}: {d.prefix + part} has shape {tuple(tensor.shape)}, "
                            f"expected {shapes[part]}"
                        )
                    self.register_buffer(f"{part}{i}", tensor)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        x = states.float()
        for i, (activation, lora) in enumerate(zip(self.activations, self.loras, strict=True)):
            y = F.linear(x, getattr(self, f"weight{i}"), getattr(self, f"bias{i}", None))
            x = activation(y if lora is None else lora.add(x, y))
        return self.final(x)


def build_head(
    task: str, config: ModelConfig, model_dir: str | Path, deltas=None
) -> nn.Module | None:
    """Rank 0's head for the task; None where an embedder's pooled vectors are its answer. A
    multi-vector retriever's is its projection of every token (it pools nothing), or None.
    `deltas`: a merged adapter's (adapters.lora_deltas), for the projections it changes."""
    if task == "rerank":
        return build_score_head(config, model_dir)
    if task == "classify":
        return ClassifierHead(config.hidden_size, "score.weight", None, config.num_labels)
    sentence = config.sentence
    if config.multi_vector:
        return build_token_head(config, deltas)
    if not sentence.has_head:
        return None
    return ProjectionHead(sentence.dense, sentence.final_activation, deltas)


def build_token_head(config: ModelConfig, deltas=None) -> nn.Module | None:
    """The checkpoint's projection of every token (a multi-vector retriever's, or
    jina-embeddings-v4's beside its pooling), or None: per-token vectors are then the final
    hidden states."""
    projection = config.sentence.token_projection
    return None if projection is None else ProjectionHead((projection,), deltas=deltas)
