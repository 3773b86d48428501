"""qwen-embed: embed or rerank texts with a Triton server from the command line.

qwen-embed embed "some text" "another" [--url HOST:PORT ...] [-o out.npy|out.jsonl]
qwen-embed embed --input texts.jsonl -o vectors.npy       # or a text file, or - for stdin
qwen-embed embed --input big.jsonl -o out/                # shards, resumed after Ctrl-C
qwen-embed embed --input docs.jsonl --chunk-size 256       # late chunking: JSONL of chunks
qwen-embed embed "a query" --per-token                    # a vector per token: JSONL
qwen-embed embed "a caption" --image photo.jpg             # a multimodal model: text + image
qwen-embed embed "what happens" --video clip.mp4            # ... or a video
qwen-embed rerank "a query" documents.txt [--top-n 5] [--instruction ...]   # JSONL, best first
qwen-embed rerank "" pages.jsonl --query-image q.png     # {"text", "images": [files]} per line
qwen-embed rerank "a goal" clips.jsonl    # ... {"text", "videos": [file, [frame files]]} per line
qwen-embed health --url HOST:PORT
qwen-embed info --url HOST:PORT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tritonclient.utils import InferenceServerException

from . import bulk
from .client import EmbeddingClient, EmbeddingError
from .contract import (
    FACTS,
    PRIORITIES,
    EmbedOptions,
    RerankOptions,
    option_flags,
    options_from_flags,
    parse_json,
    read_facts,
)

PROGRESS_CHUNK = 1024  # texts per client call when a progress bar is shown


def read_texts(args) -> list[str]:
    return read_records(args)[0]


def read_records(args) -> tuple[list[str], list]:
    """(texts, ids): a JSONL object's --id-field where it has one, else the text's index."""
    if args.texts:
        return list(args.texts), list(range(len(args.texts)))
    records = read_lines(args)
    if not (args.input or "").endswith(".jsonl"):
        return records, list(range(len(records)))
    texts, ids = [], []
    id_field = getattr(args, "id_field", "id")
    for index, record in enumerate(records):  # {"text": ...} per line, or a bare JSON string
        is_object = isinstance(record, dict)  # one with images or videos may have no text
        texts.append(record.get(args.text_field, "") if is_object else record)
        ids.append(record[id_field] if is_object and id_field in record else index)
    return texts, ids


def read_lines(args) -> list:
    """The input's non-blank lines; of a .jsonl file, each line's JSON value, a string or an
    object with its text (and media) fields of their types, else refused naming the line."""
    source = sys.stdin if args.input in (None, "-") else open(args.input, encoding="utf-8")
    with source:
        lines = [(n, line.rstrip("\n")) for n, line in enumerate(source, 1) if line.strip()]
    if not (args.input or "").endswith(".jsonl"):
        return [line for _, line in lines]
    records = []
    for n, line in lines:
        where = f"{args.input} line {n}"
        try:
            value = parse_json(line)
        except ValueError as e:
            raise EmbeddingError(f"{where} is not JSON: {e}") from None
        records.append(_record(value, args, where))
    return records


def _record(record, args, where: str):
    """A JSONL line's value as read_records and the reranker's media take it; with
    --contextual a document's chunks, a list of strings (the line, or its --text-field)."""
    if getattr(args, "contextual", False):
        chunks = record.get(args.text_field) if isinstance(record, dict) else record
        if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
            raise EmbeddingError(
                f"{where}: a document must be a list of its chunks (strings), the line or its "
                f"{args.text_field!r} field (--contextual)"
            )
        return record
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise EmbeddingError(f"{where}: each line must be a JSON string or object")
    media = [getattr(args, "image_field", None), getattr(args, "video_field", None)]
    if args.text_field not in record and not any(f in record for f in media if f):
        raise EmbeddingError(f"{where}: the object has no {args.text_field!r} field (--text-field)")
    if not isinstance(record.get(args.text_field, ""), str):
        raise EmbeddingError(f"{where}: {args.text_field!r} must be a string")
    for field, video in zip(media, (False, True), strict=True):
        paths = record.get(field, []) if field else []
        if not isinstance(paths, list) or not all(_media_path(p, video) for p in paths):
            what = "file paths, or lists of a video's frame files" if video else "file paths"
            raise EmbeddingError(f"{where}: {field!r} must be a list of {what}")
    return record


def _media_path(entry, video: bool) -> bool:
    frames = video and isinstance(entry, list) and all(isinstance(f, str) for f in entry)
    return isinstance(entry, str) or frames


def read_images(paths: list[str], flag: str, base: Path = Path()) -> list[bytes]:
    try:
        return [(base / path).read_bytes() for path in paths]
    except OSError as e:
        raise EmbeddingError(f"{flag}: {e}") from None


def flag_videos(files: list[str] | None, frame_lists: list[list[str]] | None, flag: str) -> list:
    """The videos of a flag (files) and of its -frames twin (each a list of frame files)."""
    videos = read_images(files or [], flag)
    return videos + [read_images(frames, f"{flag}-frames") for frames in frame_lists or []]


def read_videos(entries: list, flag: str, base: Path = Path()) -> list[bytes | list[bytes]]:
    """Videos named by a JSONL record: each a file's path, or a list of its frames' paths."""
    return [
        read_images(entry, flag, base)
        if isinstance(entry, list)
        else read_images([entry], flag, base)[0]
        for entry in entries
    ]


def write_vectors(path: str | None, vectors: np.ndarray, counts: np.ndarray) -> None:
    if path and path.endswith(".npy"):
        np.save(path, vectors)
        return
    lines = [
        json.dumps({"embedding": v.tolist(), "tokens": int(c)}) + "\n"
        for v, c in zip(vectors, counts, strict=True)
    ]
    if path:
        Path(path).write_text("".join(lines), encoding="utf-8")
    else:
        sys.stdout.writelines(lines)


def progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} texts")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_embed(args, client: EmbeddingClient) -> None:
    if args.image or args.video or args.video_frames:
        embed_with_media(args, client)
        return
    texts, ids = read_records(args)
    if not texts:
        raise EmbeddingError("no texts given (arguments, --input FILE, or stdin)")
    options = options_from_flags(EmbedOptions, args)
    # A file is a bulk job: it yields to interactive queries on a shared server.
    options["priority"] = args.priority or ("bulk" if args.input else "interactive")
    if args.contextual:
        write_contextual(args, client, texts, options)
        return
    chunk_size = options.pop("chunk_size")
    if chunk_size is not None:
        write_chunks(args, client, texts, chunk_size, options)
        return
    if options.pop("per_token"):
        write_token_vectors(args, client, texts, options)
        return
    if args.output and not args.output.endswith((".npy", ".jsonl")):
        # What the vectors depend on, kept in the manifest (the priority is not).
        result_options = {k: v for k, v in options.items() if k != "priority"}
        job = bulk.Job(Path(args.output), texts, ids, result_options, args.shard_size)
        try:
            bulk.run(job, lambda part: client.embed_with_usage(part, **options), not args.quiet)
        except KeyboardInterrupt:
            done = len(job.done())
            print(
                f"\nqwen-embed: interrupted with {done} of {job.shards} shards in "
                f"{args.output}; run the same command again to resume",
                file=sys.stderr,
            )
            raise SystemExit(130) from None
        return
    show = len(texts) > PROGRESS_CHUNK and not args.quiet
    vectors, counts = [], []
    step = PROGRESS_CHUNK if show else len(texts)
    for start in range(0, len(texts), step):
        try:
            result = client.embed_with_usage(texts[start : start + step], **options)
        except EmbeddingError as e:
            raise e.counted_from(start) from None
        vectors.append(result.embeddings)
        counts.append(result.token_counts)
        if show:
            progress(min(len(texts), start + step), len(texts))
    write_vectors(args.output, np.concatenate(vectors), np.concatenate(counts))


def embed_with_media(args, client: EmbeddingClient) -> None:
    """One input of a multimodal model: the video files of --video, the videos of
    --video-frames, the image files of --image and the text given (or none), one vector (a
    vector per token with --per-token)."""
    if args.input or len(args.texts) > 1:
        raise EmbeddingError("--image and --video go with one input: at most one text, no --input")
    images = read_images(args.image or [], "--image")
    videos = flag_videos(args.video, args.video_frames, "--video")
    options = options_from_flags(EmbedOptions, args)
    if options.pop("chunk_size") is not None:
        raise EmbeddingError("--image and --video take no --chunk-size")
    texts = list(args.texts) or [""]
    options |= {"images": [images], "videos": [videos], "priority": args.priority}
    if options.pop("per_token"):
        write_token_vectors(args, client, texts, options)
        return
    result = client.embed_with_usage(texts, **options)
    write_vectors(args.output, result.embeddings, result.token_counts)


def write_jsonl(args, lines: list[str]) -> None:
    if args.output:
        Path(args.output).write_text("".join(lines), encoding="utf-8")
    else:
        sys.stdout.writelines(lines)


def _jsonl_only(args, flag: str) -> None:
    if args.output and not args.output.endswith(".jsonl"):
        raise EmbeddingError(f"{flag} writes JSONL: give -o FILE.jsonl or none (stdout)")


def write_token_vectors(args, client: EmbeddingClient, texts: list[str], options: dict) -> None:
    """A JSON line per text: its token count and a vector per token."""
    _jsonl_only(args, "--per-token")
    vectors = client.embed_tokens(texts, **options)
    lines = [json.dumps({"tokens": len(v), "embeddings": v.tolist()}) + "\n" for v in vectors]
    write_jsonl(args, lines)


def write_chunks(
    args, client: EmbeddingClient, texts: list[str], chunk_size: int, options: dict
) -> None:
    """Late chunking: a JSON line per text with its chunks' characters and vectors."""
    _jsonl_only(args, "--chunk-size")
    results = client.embed_chunks(texts, chunk_size=chunk_size, **options)
    lines = [
        json.dumps(
            {
                "chunks": [
                    {"start": int(a), "end": int(b), "embedding": v.tolist()}
                    for (a, b), v in zip(r.spans, r.embeddings, strict=True)
                ],
                "tokens": r.token_count,
            }
        )
        + "\n"
        for r in results
    ]
    write_jsonl(args, lines)


def write_contextual(args, client: EmbeddingClient, documents: list, options: dict) -> None:
    """Contextual chunks: a JSON line per document, its chunks' vectors and its tokens."""
    _jsonl_only(args, "--contextual")
    if args.texts or not (args.input or "").endswith(".jsonl"):
        raise EmbeddingError("--contextual reads its documents from --input FILE.jsonl")
    if options.pop("chunk_size") is not None or options.pop("per_token"):
        raise EmbeddingError("--contextual takes neither --chunk-size nor --per-token")
    results = client.embed_contextual(documents, **options)
    lines = [
        json.dumps({"embeddings": r.embeddings.tolist(), "tokens": r.token_count}) + "\n"
        for r in results
    ]
    write_jsonl(args, lines)


def cmd_rerank(args, client: EmbeddingClient) -> None:
    args.texts, args.input = None, args.documents
    documents = read_texts(args)
    if not documents:
        raise EmbeddingError(f"no documents in {args.documents}")
    options = options_from_flags(RerankOptions, args)
    if args.query_image:
        options["query_images"] = read_images(args.query_image, "--query-image")
    query_videos = flag_videos(args.query_video, args.query_video_frames, "--query-video")
    if query_videos:
        options["query_videos"] = query_videos
    if args.documents.endswith(".jsonl"):  # each record's images and videos, beside the file
        base = Path(args.documents).parent
        records = list(enumerate(read_lines(args)))
        for field, option, read in (
            (args.image_field, "document_images", read_images),
            (args.video_field, "document_videos", read_videos),
        ):
            files = [
                read(r.get(field, []), f"{args.documents} line {i + 1}", base)
                if isinstance(r, dict)
                else []
                for i, r in records
            ]
            if any(files):
                options[option] = files
    result = client.rerank(args.query, documents, top_n=args.top_n, **options)
    for index, score in result.ranking:
        line = {"index": index, "relevance_score": score, "document": documents[index]}
        sys.stdout.write(json.dumps(line, ensure_ascii=False) + "\n")


def _grpc(url: str):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(url.split("://", 1)[-1])


def cmd_health(args) -> None:
    bad = []
    for url in args.url:
        client = _grpc(url)
        try:
            ready = client.is_server_ready() and client.is_model_ready(args.model)
        except Exception as e:  # unreachable: report, do not crash
            ready, why = False, str(e).splitlines()[0]
        else:
            why = "ready" if ready else f"model '{args.model}' not ready"
        print(f"{url}: {why}")
        if not ready:
            bad.append(url)
    if bad:
        raise EmbeddingError(f"not ready: {', '.join(bad)}")


def cmd_info(args) -> None:
    """The ensemble, its steps' parameters and the facts each step publishes in its config
    (dimension, tokens per text, prompt names, the encoder's route)."""
    for url in args.url:
        client = _grpc(url)
        config = client.get_model_config(args.model, as_json=True)["config"]
        steps = [s["model_name"] for s in config.get("ensemble_scheduling", {}).get("step", [])]
        details = {
            "url": url,
            "model": args.model,
            "steps": steps,
            "max_texts_per_request": config.get("max_batch_size"),
        }
        for step in steps:
            step_config = client.get_model_config(step, as_json=True)["config"]
            params = step_config.get("parameters", {})
            # an empty value is left out of the config's JSON
            settings = {k: v.get("string_value", "") for k, v in params.items()}
            details.update({k: v for k, v in settings.items() if k not in FACTS})
            details.update(read_facts(step_config))
        print(json.dumps(details, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="qwen-embed", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", action="append", help="server, repeatable (default localhost:8001)"
    )
    common.add_argument("--model", default="embed")
    e = sub.add_parser("embed", parents=[common], help="embed texts")
    e.add_argument("texts", nargs="*")
    e.add_argument("--input", help="text file (one text per line), .jsonl, or - for stdin")
    e.add_argument("--text-field", default="text", help="JSONL field holding the text")
    e.add_argument(
        "-o",
        "--output",
        help=".npy or .jsonl file, or a directory for a resumable job in shards "
        "(default: JSONL on stdout)",
    )
    e.add_argument("--shard-size", type=int, default=4096, help="texts per shard (directory)")
    e.add_argument("--id-field", default="id", help="JSONL field holding a text's id")
    e.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    e.add_argument("--timeout", type=float, default=120.0)
    for flag, keywords in option_flags(EmbedOptions):
        e.add_argument(flag, **keywords)
    e.add_argument(
        "--priority",
        choices=list(PRIORITIES),
        help="the server's queue level (default: bulk with --input, else interactive)",
    )
    e.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    e.add_argument(
        "--contextual",
        action="store_true",
        help="each JSONL line of --input is a document's chunks (a list of strings, or one "
        "in --text-field), each embedded in the context of the others (a model with a chunk "
        "separator: pplx-embed-context); writes a line per document",
    )
    e.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image file (a multimodal model), repeatable: embeds one input, these images "
        "and the text given",
    )
    e.add_argument(
        "--video",
        action="append",
        metavar="FILE",
        help="a video file (MP4, WebM, ...; a multimodal model), repeatable: embeds one input, "
        "these videos, the images and the text given",
    )
    e.add_argument(
        "--video-frames",
        action="append",
        nargs="+",
        metavar="FILE",
        help="a video given as its frames' image files, in order (a multimodal model), "
        "repeatable: one video each time",
    )
    r = sub.add_parser("rerank", parents=[common], help="score documents against a query")
    r.add_argument("query")
    r.add_argument("documents", help="text file (one document per line), .jsonl, or - for stdin")
    r.add_argument("--text-field", default="text", help="JSONL field holding the document")
    r.add_argument(
        "--image-field",
        default="images",
        help="JSONL field holding a document's image files (a multimodal reranker; paths "
        "relative to the JSONL file)",
    )
    r.add_argument(
        "--query-image",
        action="append",
        metavar="FILE",
        help="an image of the query (a multimodal reranker), repeatable",
    )
    r.add_argument(
        "--query-video",
        action="append",
        metavar="FILE",
        help="a video of the query (a multimodal reranker), repeatable",
    )
    r.add_argument(
        "--query-video-frames",
        action="append",
        nargs="+",
        metavar="FILE",
        help="a video of the query given as its frames' image files, in order, repeatable",
    )
    r.add_argument(
        "--video-field",
        default="videos",
        help="JSONL field holding a document's videos: each a video file's path, or a list of "
        "its frames' image files (paths relative to the JSONL file)",
    )
    r.add_argument("--top-n", type=int, help="the best N documents only")
    for flag, keywords in option_flags(RerankOptions):
        r.add_argument(flag, **keywords)
    r.add_argument("--rerank-model", default="rerank")
    r.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    r.add_argument("--timeout", type=float, default=120.0)
    sub.add_parser("health", parents=[common], help="readiness of each server")
    sub.add_parser("info", parents=[common], help="model, dimension, limits and route")
    args = p.parse_args(argv)
    args.url = args.url or ["localhost:8001"]
    try:
        if args.command == "embed":
            with EmbeddingClient(
                args.url, protocol=args.protocol, timeout=args.timeout, model=args.model
            ) as client:
                cmd_embed(args, client)
        elif args.command == "rerank":
            with EmbeddingClient(
                args.url,
                protocol=args.protocol,
                timeout=args.timeout,
                rerank_model=args.rerank_model,
            ) as client:
                cmd_rerank(args, client)
        elif args.command == "health":
            cmd_health(args)
        else:
            cmd_info(args)
    except (EmbeddingError, InferenceServerException, OSError, ValueError) as e:
        print(f"qwen-embed: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
