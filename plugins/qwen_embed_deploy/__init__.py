"""Deployment tooling beside the engine: installing Triton and the GPU stack, building the demo
checkpoints, rendering model repositories and launching the server. The engine (`qwen_embed`)
never imports this package."""
