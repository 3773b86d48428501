"""python -m qwen_embed_client ... (same as the qwen-embed command)."""

import sys

from .cli import main

sys.exit(main())
