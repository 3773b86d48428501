import sys

from .app import main
from .keys import new_key

if sys.argv[1:2] == ["new-key"]:  # python -m qwen_embed_client.gateway new-key NAME ...
    new_key(sys.argv[2:])
else:
    main()
