"""Shared pytest fixtures: tiny random checkpoints (see ``tests/tiny_models.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.tiny_models import FAMILIES, cached_build, default_cache_root


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
    root = default_cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-probe"
        probe.touch()
        probe.unlink()
    except OSError:
        root = tmp_path_factory.mktemp("tiny-models")
    return root


@pytest.fixture(scope="session")
def tiny_models(tiny_cache_root: Path) -> Callable[[str], Path]:
    """``tiny_models(family) -> Path`` of a tiny random checkpoint folder; built once, then cached."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
        if family not in cache:
            path = cached_build(family, cache_root=tiny_cache_root)
            assert path is not None
            cache[family] = path
        return cache[family]

    return get


@pytest.fixture(scope="session")
def real_tokenizer_models(tiny_cache_root: Path) -> Callable[[str], Path]:
    """``real_tokenizer_models(family) -> Path``: tiny model + real tokenizer/config; skips if unavailable."""
    cache: dict[str, Path | None] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = cached_build(family, real=True, cache_root=tiny_cache_root)
        path = cache[family]
        if path is None:
            pytest.skip(f"no real tokenizer for {family!r} (shared/tokenizers absent or not provided)")
        return path

    return get
