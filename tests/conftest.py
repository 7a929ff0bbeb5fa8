"""Shared pytest fixtures: the tiny random checkpoints of ``tests/tiny_models.py`` (the registry that builds them)
and a temporary ``SEQGEN_CACHE``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.tiny_models import cached_build, checkpoint, writable_cache_root


@pytest.fixture(autouse=True, scope="session")
def int8_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``--dtype int8`` caches quantized weights (``models/int8_cache.py``): in a temp folder, not the user's."""
    import os

    folder = tmp_path_factory.mktemp("seqgen-cache")
    old = os.environ.get("SEQGEN_CACHE")
    os.environ["SEQGEN_CACHE"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("SEQGEN_CACHE", None)
    else:
        os.environ["SEQGEN_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cross-session cache folder (``~/.cache/seqgen-tests/<hash>``), or a session temp dir if unwritable."""
    return writable_cache_root() or tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_models(tiny_cache_root: Path) -> Callable[[str], Path]:
    """``tiny_models(family) -> Path`` of a tiny random checkpoint folder (``tests/tiny_models.py``: built once,
    then cached)."""
    return functools.partial(checkpoint, cache_root=tiny_cache_root)


@pytest.fixture(scope="session")
def real_tokenizer_models(tiny_cache_root: Path) -> Callable[[str], Path]:
    """``real_tokenizer_models(family) -> Path``: tiny model + real tokenizer/config; skips if unavailable."""

    def get(family: str) -> Path:
        path = cached_build(family, real=True, cache_root=tiny_cache_root)
        if path is None:
            pytest.skip(f"no real tokenizer for {family!r} (shared/tokenizers absent or not provided)")
        return path

    return get
