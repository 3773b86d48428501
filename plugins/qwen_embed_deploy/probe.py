"""Liveness probe: one real embedding through the server, exit 0 if it came back, else 1.

    python -m qwen_embed_deploy.probe [--url 127.0.0.1:8000] [--model embed] [--timeout 10]

Triton 2.51 keeps answering /v2/health/ready after a model's Python stub has died while every
request to that model fails, so liveness must send a request. Standard library only, so the
probe starts fast; used by the Docker HEALTHCHECK and the Kubernetes livenessProbe.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def probe(url: str, model: str, timeout: float) -> str | None:
    """None when healthy, else what went wrong."""
    body = {
        "inputs": [
            {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["liveness probe"]}
        ],
        "outputs": [{"name": "EMBEDDING"}],
    }
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/infer", data=json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            outputs = json.loads(response.read())["outputs"]
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
    except (OSError, ValueError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    if not outputs or not outputs[0].get("data"):
        return "the response held no embedding"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="127.0.0.1:8000", help="Triton's HTTP address")
    p.add_argument("--model", default="embed")
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    problem = probe(args.url, args.model, args.timeout)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        sys.exit(1)
    print("healthy")


if __name__ == "__main__":
    main()
