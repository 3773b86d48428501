"""The tokenizer's per-request views on the real Qwen vocabulary (the demo checkpoint's
tokenizer.json): token-id inputs, the request's own token limit, TEI's /tokenize tokens,
decoding, and the reranker's per-document cap."""

import numpy as np
import pytest

from qwen_embed_client.contract import EmbedOptions, RequestError, RerankOptions
from qwen_embed_client.gateway.jina import input_spans
from qwen_embed_deploy.serving.rerank import PairTokenizer
from qwen_embed_deploy.serving.tokenizer import TextTokenizer, load_tokenizer

EOS = 151643
HELLO = [9707, 11, 1879, 0]  # "Hello, world!"


@pytest.fixture(scope="module")
def tok(demo_dir):
    return TextTokenizer(demo_dir, 32)


def test_token_ids_are_taken_as_given_within_the_same_limits(tok):
    ids, counts = tok.encode_ids([np.array(HELLO + [EOS], np.int32)], EmbedOptions(token_ids=True))
    assert ids == [HELLO + [EOS]] and counts == [5]
    long = np.array([*range(100, 139), EOS], dtype=np.int32)
    (right,), _ = tok.encode_ids([long], EmbedOptions(token_ids=True))
    (left,), _ = tok.encode_ids([long], EmbedOptions(token_ids=True, truncation_direction="left"))
    # cut as a text is: its own tokens, the closing <|endoftext|> kept
    assert right == [*range(100, 131), EOS] and left == [*range(108, 139), EOS]
    with pytest.raises(RequestError, match=r"has 40 tokens, more than the limit of 32"):
        tok.encode_ids([long], EmbedOptions(token_ids=True, truncate=False))
    with pytest.raises(RequestError, match="outside this model's vocabulary"):
        tok.encode_ids([np.array([1, -5], np.int32)], EmbedOptions(token_ids=True))


def test_token_ids_of_another_tokenizer_are_refused(tok):
    """Ids without the <|endoftext|> this tokenizer closes every text with (tiktoken's, as
    LangChain's OpenAIEmbeddings sends them) are refused for a vector, and decoded as given."""
    tiktoken = np.array([9906, 11, 1917, 0], np.int32)  # cl100k_base's "Hello, world!"
    for ids in (tiktoken, np.array([EOS], np.int32)[:0], np.array([EOS, 1], np.int32)):
        with pytest.raises(RequestError) as e:
            tok.encode_ids([ids], EmbedOptions(token_ids=True))
        assert "'TEXT[0]' token ids must end with [151643] (<|endoftext|>)" in str(e.value)
        assert "check_embedding_ctx_length=False" in str(e.value)
    decoded, _ = tok.encode_ids([tiktoken], EmbedOptions(token_ids=True), readout=False)
    assert decoded == [tiktoken.tolist()]


def test_late_chunking_by_characters_takes_the_tokens_that_begin_in_each_span(tok):
    """Jina's late chunking: each input's tokens in the joined text, a token that begins in the
    separator before an input being that input's; the prompt's tokens are not counted (one
    straddling its end begins at the text's 0)."""
    texts = ["Hi there.", "Ünï", "x"]  # joined "Hi there. Ünï x": 15 characters
    spans = input_spans(texts)
    assert spans == [[0, 9], [9, 13], [13, 15]]
    # the text's own tokens: "H" straddles the prompt's end, " Ün" begins at the separator
    offsets = [(0, 1), (1, 2), (2, 8), (8, 9), (9, 12), (12, 13), (13, 15)]
    chunks = TextTokenizer._char_chunks(0, offsets, spans, 15)
    assert chunks.tolist() == [[0, 4], [4, 6], [6, 7]]
    with pytest.raises(RequestError, match=r"'chunk_chars'\[0\] = \[0, 16\] goes past the 15"):
        TextTokenizer._char_chunks(0, offsets, [[0, 16]], 15)
    with pytest.raises(
        RequestError, match=r"'chunk_chars'\[1\] = \[10, 12\] holds the start of no"
    ):
        TextTokenizer._char_chunks(0, offsets, [[0, 9], [10, 12]], 15)
    # through the real tokenizer, with Qwen3-Embedding's query prompt before the text
    opts = EmbedOptions(prompt_name="query", chunk_chars=tuple(map(tuple, spans)))
    _, (chunks,), _ = tok.encode_chunks([" ".join(texts)], opts)
    starts, ends = chunks.chars[:, 0].tolist(), chunks.chars[:, 1].tolist()
    assert ends[-1] == 15 and starts[1:] == ends[:-1]  # the inputs' tokens, one after another


def test_max_tokens_is_the_requests_own_limit(tok):
    text = "word " * 50
    ids, counts = tok.encode_counted([text], EmbedOptions(max_tokens=8))
    assert len(ids[0]) == 8 and ids[0][-1] == EOS and counts == [52]  # the special token kept
    assert (
        tok.encode([text], EmbedOptions(max_tokens=1000))[0]
        == tok.encode([text], EmbedOptions())[0]
    )
    with pytest.raises(RequestError, match="more than the limit of 8"):
        tok.encode([text], EmbedOptions(max_tokens=8, truncate=False))


def test_tokens_are_teis_shape_with_byte_offsets(tok):
    (tokens,) = tok.tokens(tok.encoded(["naïve café"], EmbedOptions(prompt="t: "), offsets=True))
    text = "t: naïve café".encode()
    assert [t["id"] for t in tokens] == tok.encode(["naïve café"], EmbedOptions(prompt="t: "))[0]
    for t in tokens[:-1]:
        assert text[t["start"] : t["stop"]].decode() == t["text"] and not t["special"]
    assert tokens[-1] == {
        "id": EOS,
        "text": "<|endoftext|>",
        "special": True,
        "start": None,
        "stop": None,
    }
    assert tok.decode([[t["id"] for t in tokens]]) == [
        ("t: naïve café", "t: naïve café<|endoftext|>")
    ]
    # Ids alone skip the offsets: the same ids, and no token view made of zero offsets.
    texts = ["naïve café", "你好，世界！", "tabs\tand\nnewlines", "emoji 🎉", "  a  b  ", "x" * 300]
    plain = tok.encoded(texts, EmbedOptions(prompt="t: "))
    full = tok.encoded(texts, EmbedOptions(prompt="t: "), offsets=True)
    assert [e.ids for e in plain] == [e.ids for e in full]
    assert plain[0].ids == [t["id"] for t in tokens]
    with pytest.raises(ValueError, match="encoded with offsets"):
        tok.tokens(plain)


def test_a_reranker_document_cut_to_its_first_tokens(demo_dir):
    pairs = PairTokenizer(demo_dir, 512)
    document = "Beijing is the capital of China and its second largest city."
    whole = pairs.encode("q", [document], RerankOptions())[0]
    cut = pairs.encode("q", [document], RerankOptions(max_document_tokens=2))[0]
    end = load_tokenizer(demo_dir).encode(document, add_special_tokens=False).offsets[1][1]
    first_two = pairs.encode("q", [document[:end]], RerankOptions())[0]
    assert cut == first_two and len(cut) < len(whole)
