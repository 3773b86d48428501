"""Everything between the engine and a running server: the Triton adapter the model
repository's model.py files import (`serving/`: settings, tokenization, prompts, rerank
templates; `compact`, `placement`, `host`), Ray Data with the engine in each actor
(`ray_data`), and the tooling: installing Triton and the GPU stack, building the demo
checkpoints, rendering model repositories and launching the server. The engine (`qwen_embed`)
never imports this package; the modules the tokenizer models import never import torch."""
