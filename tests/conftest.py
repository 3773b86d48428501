import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from reference import TINY_CONFIGS, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> directory of a seeded tiny model, built once per session."""
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_checkpoint(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


@pytest.fixture(params=sorted(TINY_CONFIGS))
def config_name(request):
    return request.param
