"""Triton adapter for the tokenizer step of both ensembles (parameter `task`):
embed: TEXT -> TOKEN_IDS, TOKEN_COUNT, INPUT_TOKENS (qwen_embed_deploy.serving.tokenizer), and for
a direct call the TOKENS or DECODED views; for a multimodal checkpoint every text in its chat
template, with the videos of VIDEOS and the images of IMAGES resized and sent on as MEDIA
(serving/videos.py, serving/images.py);
rerank: QUERY + DOCUMENTS -> one templated pair per document (qwen_embed_deploy.serving.rerank),
for a multimodal reranker with the videos and images of QUERY_VIDEOS, QUERY_IMAGES,
DOCUMENT_VIDEOS and DOCUMENT_IMAGES in each pair's MEDIA; for a listwise reranker, a row per
document, each block's sequence on its first document's (serving/listwise.py)."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from qwen_embed_client.contract import (
    MAX_DECODED_PIXELS,
    MAX_TEXTS_PER_REQUEST,
    MAX_VIDEO_FRAMES,
    EmbedOptions,
    RequestError,
    RerankOptions,
    decode_id_lists,
    decode_texts,
    finish_rows,
    pack_chunks,
    pack_ids,
    pack_media,
    required,
    stack_ragged,
    unpack_frames,
    unpack_images,
)
from qwen_embed_deploy.host import gpu_count
from qwen_embed_deploy.placement import read_topology, tokenizer_placement
from qwen_embed_deploy.serving import videos
from qwen_embed_deploy.serving.config import (
    model_parameters,
    tokenizer_checkpoint,
    tokenizer_settings,
)
from qwen_embed_deploy.serving.images import ImageSettings, decode, resized, tokens_of
from qwen_embed_deploy.serving.rerank import pair_tokenizer
from qwen_embed_deploy.serving.tokenizer import TextTokenizer, ids_and_counts, image_blocks


class TritonPythonModel:
    def initialize(self, args):
        settings = tokenizer_settings(model_parameters(args))
        model_dir, config, max_tokens = tokenizer_checkpoint(settings)
        # On machines with a core to spare, tokenizers keep off the CPU encoders' cores.
        spare = tokenizer_placement(read_topology(), gpu_count())
        if spare is not None and settings.cpu_pinning != "off":
            os.sched_setaffinity(0, spare.cpus)
        self.task = settings.task
        self.embedding_size = config.embedding_size
        # Texts per request: the batching tokenizer's max_batch_size (Triton refuses more).
        batch = json.loads(args["model_config"]).get("max_batch_size", 0)
        self.max_texts = batch or MAX_TEXTS_PER_REQUEST
        self.max_text_bytes = settings.max_text_bytes
        if self.task == "rerank":
            self.tokenizer = pair_tokenizer(model_dir, max_tokens)
            self._tokenize = self._pairs
        else:
            self.tokenizer = TextTokenizer(model_dir, max_tokens, settings.truncation_direction)
            self._tokenize = self._texts
        self.image_settings = ImageSettings.from_dir(model_dir)

    def execute(self, requests):
        # No timer of its own: Triton's statistics time each execute (batch_stats), and a
        # pb_utils metric call is a round trip to the server.
        return [self._one(request) for request in requests]

    def _texts(self, request, params):
        opts = EmbedOptions.from_parameters(params)
        opts.check_model(self.embedding_size, self.tokenizer.prompts.names)
        raw = required(pb_utils.get_input_tensor_by_name(request, "TEXT"), "TEXT")
        asked = set(request.requested_output_names())
        given = {name: self._files(request, name, raw.size) for name in ("VIDEOS", "IMAGES")}
        template = self.tokenizer.chat  # a prompted one writes texts alone as any model's
        if (template is not None and not template.prompted) or any(map(any, given.values())):
            if asked & {"TOKENS", "DECODED"}:
                raise RequestError(
                    "outputs 'TOKENS' and 'DECODED' are not available for a multimodal model, "
                    "whose texts are written in its chat template"
                )
            return self._chat(raw, given, opts)
        if opts.token_ids:
            lists = decode_id_lists(raw, self.max_texts, self.max_text_bytes)
            ids, counts = self.tokenizer.encode_ids(lists, opts, readout="DECODED" not in asked)
            texts = lists
        else:
            texts = decode_texts(raw, self.max_texts, self.max_text_bytes)
        extra = [pb_utils.Tensor("FINISH", finish_rows(self.tokenizer.finish(opts), len(texts)))]
        encoded = None
        if opts.chunked:
            ids, chunks, counts = self.tokenizer.encode_chunks(texts, opts)
            packed = np.array([[pack_chunks(c.tail, c.tokens)] for c in chunks], np.object_)
            # Characters of each chunk, -1 past a text's own chunks.
            spans = stack_ragged([c.chars for c in chunks], -1, np.int32)
            extra += [pb_utils.Tensor("CHUNKS", packed), pb_utils.Tensor("CHUNK_SPANS", spans)]
        else:  # CHUNKS is always sent: the encoder step waits for it
            if not opts.token_ids:
                encoded = self.tokenizer.encoded(texts, opts, offsets="TOKENS" in asked)
                ids, counts = ids_and_counts(encoded)
            none = np.array([[b""]] * len(ids), dtype=np.object_)
            extra.append(pb_utils.Tensor("CHUNKS", none))
        # Asked for only by a direct call (the /tokenize and /decode routes), never by the
        # ensembles: nothing to compute on the embedding path.
        if "TOKENS" in asked and not opts.token_ids:
            if encoded is None:
                encoded = self.tokenizer.encoded(texts, opts, offsets=True)
            views = self.tokenizer.tokens(encoded)
            tokens = np.array([json.dumps(t).encode() for t in views], np.object_)
            extra.append(pb_utils.Tensor("TOKENS", tokens.reshape(-1, 1)))
        if "DECODED" in asked:
            decoded = [[a.encode(), b.encode()] for a, b in self.tokenizer.decode(ids)]
            extra.append(pb_utils.Tensor("DECODED", np.array(decoded, dtype=np.object_)))
        counts = np.array(counts, dtype=np.int32).reshape(-1, 1)
        none = np.array([[b""]] * len(ids), dtype=np.object_)  # the encoder step waits for it
        return ids, [
            pb_utils.Tensor("INPUT_TOKENS", counts),
            pb_utils.Tensor("MEDIA", none),
            *extra,
        ]

    def _chat(self, raw, given, opts):
        """A multimodal checkpoint's texts, with the videos of VIDEOS and the images of IMAGES
        (`given`: per input, per text its files), in its template (serving/tokenizer.py's
        media_template: a chat turn, or a retriever's processor's forms); MEDIA carries each
        text's resized frames and images to the encoder, in that order (the script's)."""
        template = self.tokenizer.chat
        for name, files in given.items():
            kind = name.lower()
            if any(files) and (template is None or (kind == "videos" and not template.reads_video)):
                what = "text only" if template is None else "texts and images"
                raise RequestError(f"input '{name}' holds {kind}, and this model reads {what}")
            if any(files) and (opts.token_ids or opts.chunked):
                raise RequestError(f"input '{name}' goes with texts: not with token_ids or chunks")
        most = template.visuals_per_text  # where a template limits them, it reads no video
        if most is not None:
            for i, images in enumerate(given["IMAGES"]):
                if len(images) > most:
                    raise RequestError(
                        f"input 'IMAGES[{i}]' holds {len(images)} images; this model reads "
                        f"{most} per text"
                    )
        if opts.token_ids or opts.chunked:
            raise RequestError(
                "parameters 'token_ids', 'chunk_size', 'chunk_spans', 'chunk_chars' and "
                "'chunk_by_separator' are not "
                "available for a multimodal model, whose texts are written in its chat template"
            )
        with_media = frozenset(
            i for i, (v, im) in enumerate(zip(*given.values(), strict=True)) if v or im
        )
        texts = decode_texts(raw, self.max_texts, self.max_text_bytes, may_be_empty=with_media)
        visuals, arrays = self._visuals(given, opts)
        fields = ["VIDEOS" if v else "IMAGES" for v in given["VIDEOS"]]
        ids, counts = self.tokenizer.encode_media(texts, visuals, opts, fields)
        media = np.array([[pack_media(a)] for a in arrays], dtype=np.object_)
        counts = np.array(counts, dtype=np.int32).reshape(-1, 1)
        none = np.array([[b""]] * len(ids), dtype=np.object_)
        return ids, [
            pb_utils.Tensor("INPUT_TOKENS", counts),
            pb_utils.Tensor("FINISH", finish_rows(self.tokenizer.finish(opts), len(ids))),
            pb_utils.Tensor("CHUNKS", none),
            pb_utils.Tensor("MEDIA", media),
        ]

    def _image(self, name, element, index, data):
        try:
            return resized(decode(data, MAX_DECODED_PIXELS), self.image_settings)
        except ValueError as e:
            raise RequestError(f"input '{name}[{element}]' image {index} {e}") from None

    def _video(self, name, element, index, data, opts):
        where = f"input '{name}[{element}]' video {index}"
        frames = unpack_frames(data, where)  # None: a video file
        try:
            if frames is not None:
                keep = opts.video_max_frames
                return videos.read_frames(frames, self.image_settings, MAX_DECODED_PIXELS, keep)
            sampling = (opts.video_fps, opts.video_max_frames)
            return videos.read(
                data, self.image_settings, MAX_VIDEO_FRAMES, MAX_DECODED_PIXELS, sampling
            )
        except ValueError as e:
            raise RequestError(f"{where} {e}") from None

    def _pairs(self, request, params):
        opts = RerankOptions.from_parameters(params)
        raw = required(pb_utils.get_input_tensor_by_name(request, "DOCUMENTS"), "DOCUMENTS")
        given = {
            name: self._files(request, name, 1 if name.startswith("QUERY") else raw.size)
            for name in ("QUERY_VIDEOS", "QUERY_IMAGES", "DOCUMENT_VIDEOS", "DOCUMENT_IMAGES")
        }
        with_media = frozenset(
            i
            for i, (v, im) in enumerate(
                zip(given["DOCUMENT_VIDEOS"], given["DOCUMENT_IMAGES"], strict=True)
            )
            if v or im
        )
        documents = decode_texts(
            raw, self.max_texts, self.max_text_bytes, name="DOCUMENTS", may_be_empty=with_media
        )
        raw = required(pb_utils.get_input_tensor_by_name(request, "QUERY"), "QUERY")
        query_media = given["QUERY_VIDEOS"][0] or given["QUERY_IMAGES"][0]
        (query,) = decode_texts(  # exactly one
            raw,
            1,
            self.max_text_bytes,
            name="QUERY",
            may_be_empty=frozenset([0] if query_media else []),
        )
        if not query_media and not with_media:
            none = np.array([[b""]] * len(documents), dtype=np.object_)
            return self.tokenizer.encode(query, documents, opts), [pb_utils.Tensor("MEDIA", none)]
        tokenizer = self.tokenizer
        for name, files in given.items():
            video = name.endswith("VIDEOS")
            if any(files) and not (tokenizer.reads_video if video else tokenizer.reads_images):
                kind = "videos" if video else "images"
                reads = "images" if tokenizer.reads_images else "text only"
                raise RequestError(f"input '{name}' holds {kind}, and this reranker reads {reads}")
        (query_visuals,), (query_arrays,) = self._visuals(given, opts, "QUERY_")
        document_visuals, document_arrays = self._visuals(given, opts, "DOCUMENT_")
        fields = [f"DOCUMENT_{'VIDEOS' if v else 'IMAGES'}" for v in given["DOCUMENT_VIDEOS"]]
        ids = tokenizer.encode(query, documents, opts, query_visuals, document_visuals, fields)
        # Each pair's MEDIA holds its visuals in the order of their placeholders.
        media = [
            [
                pack_media(
                    arrays + query_arrays if tokenizer.document_first else query_arrays + arrays
                )
            ]
            for arrays in document_arrays
        ]
        return ids, [pb_utils.Tensor("MEDIA", np.array(media, dtype=np.object_))]

    def _visuals(self, given, opts, side=""):
        """Per element of inputs `{side}VIDEOS` and `{side}IMAGES` (`given`: per input, per
        element its files; `opts` the request's, its video sampling): (its placeholder text,
        videos first; its resized frames and images for MEDIA in that order)."""
        videos_in, images_in = f"{side}VIDEOS", f"{side}IMAGES"
        clips = [
            [self._video(videos_in, i, j, data, opts) for j, data in enumerate(files)]
            for i, files in enumerate(given[videos_in])
        ]
        images = [
            [self._image(images_in, i, j, data) for j, data in enumerate(files)]
            for i, files in enumerate(given[images_in])
        ]
        texts = [
            "".join(videos.placeholders(v, self.image_settings) for v in vs)
            + image_blocks([tokens_of(rgb, self.image_settings) for rgb in im])
            for vs, im in zip(clips, images, strict=True)
        ]
        return texts, [[v.frames for v in vs] + im for vs, im in zip(clips, images, strict=True)]

    def _files(self, request, name, count):
        """An optional input of packed image or video files (contract.pack_images): per
        element, its files ([] where absent)."""
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return [[]] * count
        blobs = tensor.as_numpy().reshape(-1)
        if len(blobs) != count:
            raise RequestError(
                f"input '{name}' must hold one element per text ({count}), got {len(blobs)}"
            )
        return [unpack_images(b, i, name) for i, b in enumerate(blobs)]

    def _one(self, request):
        params = json.loads(request.parameters() or "{}")
        try:
            ids, extra = self._tokenize(request, params)
        except RequestError as e:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
            )
        packed = np.array([[pack_ids(x)] for x in ids], dtype=np.object_)
        counts = np.array([[len(x)] for x in ids], dtype=np.int32)
        # checked as an option by _tokenize; the encoder knows which it serves
        adapter = np.array([[(params.get("adapter") or "").encode()]] * len(ids), np.object_)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("TOKEN_IDS", packed),
                pb_utils.Tensor("TOKEN_COUNT", counts),
                pb_utils.Tensor("ADAPTER", adapter),
                *extra,
            ]
        )
