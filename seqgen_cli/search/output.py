"""Kept only for ``greedy.py`` and ``sampling.py``, which import :class:`SearchOutput` from here until their
owners' changes land; it lives in ``protocol.py``. Delete this file with those two imports."""

from seqgen_cli.search.protocol import SearchOutput

__all__ = ["SearchOutput"]
