"""Target languages (``--target-lang``): a language code or a language as users type it (``de``, ``deu``, ``de_DE``,
``zh-TW``) to the token a many-to-many translation model is steered with: mBART-50's, M2M-100's and NLLB's forced
first token (:func:`resolve_target_lang`, its id: ``forced_bos_token_id``) or a multi-target OPUS-MT model's
``>>code<<`` before each input (:func:`resolve_target_prefix`). Codes the tokenizer spells itself need nothing more;
other spellings are matched by CLDR's language distance (``langcodes``)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from seqgen_cli.errors import SeqgenError

# A language code as multilingual tokenizers spell their special tokens: mBART-50 ``de_DE``, NLLB ``deu_Latn``,
# M2M-100 ``__de__`` (and its bare code ``de``).
_LANG_CODE = re.compile(r"(?:__)?[a-z]{2,3}(?:_[A-Za-z]{2,4})?(?:__)?")
TARGET_LANG_FAMILIES = "mBART-50, M2M-100 and NLLB tokenizers have them"


def _extra_special_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's extra special tokens (transformers 5 ``extra_special_tokens``; 4 ``additional_...``)."""
    tokens: list[str] = []
    for name in ("extra_special_tokens", "additional_special_tokens"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list | tuple):
            tokens += [str(t) for t in value if str(t) not in tokens]
    return tokens


def language_codes(tokenizer: Any) -> dict[str, int]:
    """A tokenizer's language codes and their token ids: mBART-50's ``lang_code_to_id`` (``de_DE``), M2M-100's
    ``lang_code_to_id`` and ``lang_token_to_id`` (``de``, ``__de__``), and the extra special tokens spelled as
    language codes (NLLB's ``deu_Latn``, and any tokenizer saved with such tokens, a plain one included)."""
    codes: dict[str, int] = {}
    for name in ("lang_code_to_id", "lang_token_to_id"):
        mapping = getattr(tokenizer, name, None)
        if isinstance(mapping, dict):
            codes.update({str(k): v for k, v in mapping.items() if isinstance(v, int) and k not in codes})
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in _extra_special_tokens(tokenizer):
        if token in codes or not _LANG_CODE.fullmatch(token):
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != unk:
            codes[token] = token_id
    return codes


_PREFIX_CODE = re.compile(r">>(\w+)<<")  # OPUS-MT's target language tokens: >>por<<


def prefix_codes(tokenizer: Any) -> dict[str, str]:
    """A multi-target OPUS-MT tokenizer's target languages (``>>por<<`` tokens of its vocabulary, which such a model
    reads at the start of its source): code -> token (``por`` -> ``>>por<<``); empty for other tokenizers."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return {m.group(1): token for token in vocab if (m := _PREFIX_CODE.fullmatch(token))}


def check_target(code: str | None, settings: Mapping[str, Any]) -> None:
    """``--target-lang`` is the forced first token: a ``forced_bos_token_id`` given beside it contradicts it."""
    if code is not None and "forced_bos_token_id" in settings:
        raise SeqgenError("--target-lang and --forced-bos-token-id contradict; give one")


def resolve_target_prefix(tokenizer: Any, code: str | None) -> str | None:
    """For a multi-target OPUS-MT tokenizer (:func:`prefix_codes`), the text that makes the model translate into
    ``code``: its token and a space, to go before every input (``por``, ``>>por<<`` or ``pt`` -> ``">>por<< "``);
    ``None`` for other tokenizers (and no ``code``). One-line :class:`SeqgenError` when ``code`` is none of its
    languages."""
    if code is None or not (codes := prefix_codes(tokenizer)):
        return None
    bare = code.strip()
    bare = m.group(1) if (m := _PREFIX_CODE.fullmatch(bare)) else bare
    found = [bare] if bare in codes else same_language(bare, dict.fromkeys(codes, 0))
    if len(found) == 1:
        return codes[found[0]] + " "
    where = f"--target-lang {code}"
    listed = ", ".join(sorted(codes)[:8]) + (", ..." if len(codes) > 8 else "")
    raise SeqgenError(f"{where}: not a target language of the model ({listed}: its >>code<< tokens)")


LANGUAGE_DISTANCE = 4  # CLDR's distance between language tags, at most: the same language (de-AT and de-DE: 4)


def _language_tag(code: str) -> str | None:
    """A language code as a BCP 47 tag without its region, its likely script filled in (``de_DE`` -> ``de-Latn``,
    ``zh_TW`` -> ``zh-Hant``, ``deu_Latn`` -> ``de-Latn``, mBART-50's ``en_XX`` -> ``en-Latn``), or ``None``."""
    import langcodes

    tag = "-".join(p for p in code.strip().strip("_").replace("_", "-").split("-") if p != "XX")
    if not tag or not langcodes.tag_is_valid(tag):
        return None
    full = langcodes.Language.get(tag).maximize()
    return langcodes.Language.make(language=full.language, script=full.script).to_tag() if full.language else None


def same_language(code: str, codes: dict[str, int]) -> list[str]:
    """The tokenizer's codes for the language of ``code`` as users type it (ISO 639-1 ``de``, 639-3 ``deu``, a
    locale ``de_DE`` or ``de-AT``, ``zh-TW``), by CLDR's language matching (``langcodes``): the nearest, at most
    :data:`LANGUAGE_DISTANCE` apart, regions aside (``de`` -> NLLB's ``deu_Latn``, ``ar`` -> ``arb_Arab``, ``fa``
    -> ``pes_Arab``, ``no`` -> ``nob_Latn``; ``sr-Latn`` is not ``srp_Cyrl``). Empty where none is; one line
    where ``langcodes``, a dependency, is not installed (the codes the tokenizer spells itself need no matching)."""
    try:
        import langcodes
    except ImportError:
        example = next(iter(codes), "")
        raise SeqgenError(
            f"--target-lang {code}: matching a language to the model's codes needs langcodes, a dependency of "
            f"seqgen that is not installed (pip install langcodes), or give the tokenizer's own code{f' ({example}, ...)' if example else ''}"
        ) from None
    wanted = _language_tag(code)
    if wanted is None:
        return []
    near: dict[str, int] = {}
    for name in codes:
        tag = _language_tag(name)
        if tag is not None and (d := langcodes.tag_distance(wanted, tag)) <= LANGUAGE_DISTANCE:
            near[name] = d
    best = min(near.values(), default=None)
    return [name for name, d in near.items() if d == best]


def resolve_target_lang(tokenizer: Any, code: str) -> int:
    """The token id of target language ``code`` (the ``forced_bos_token_id`` that makes mBART-50, M2M-100 and
    NLLB translate into it): the exact code, then the families' other spellings (``de-DE`` for ``de_DE``,
    ``__de__`` and ``de`` for each other, ``get_lang_id``, any letter case), then the code of the same language
    (:func:`same_language`: ``de`` or ``deu`` for NLLB's ``deu_Latn``). One-line :class:`SeqgenError`
    listing close codes when ``code`` is none of the tokenizer's, or when it has none."""
    codes = language_codes(tokenizer)
    bare = code.strip().strip("_").replace("-", "_")
    spellings = list(dict.fromkeys((code, code.strip(), bare, f"__{bare}__")))
    for spelling in spellings:
        if spelling in codes:
            return codes[spelling]
    get_lang_id = getattr(tokenizer, "get_lang_id", None)  # M2M-100: "de" -> the id of __de__
    if callable(get_lang_id) and bare:
        try:
            found = get_lang_id(bare)
        except (KeyError, ValueError, TypeError, AttributeError):
            found = None
        if isinstance(found, int):
            return found
    folded: dict[str, set[int]] = {}
    for name, token_id in codes.items():
        folded.setdefault(name.lower(), set()).add(token_id)
    for spelling in spellings:
        ids = folded.get(spelling.lower(), set())
        if len(ids) == 1:
            return next(iter(ids))
    where = f"--target-lang {code}"
    if not codes:
        raise SeqgenError(f"{where}: the model's tokenizer has no language codes ({TARGET_LANG_FAMILIES})")
    same = same_language(code, codes)
    if len({codes[name] for name in same}) == 1:
        return codes[same[0]]
    if same:
        raise SeqgenError(f"{where}: more than one of the model's language codes is that language: {', '.join(same)}")
    names: dict[int, str] = {}  # one name per language: the first spelling (M2M-100: "de" before "__de__")
    for name, token_id in codes.items():
        names.setdefault(token_id, name)
    by_lower = {name.lower(): names[token_id] for name, token_id in codes.items()}
    wanted = bare.lower() or code.lower()
    close = difflib.get_close_matches(wanted, list(by_lower), n=8, cutoff=0.5)
    language = wanted.split("_")[0]  # the same language first (de_XX: de_DE before en_XX)
    close.sort(key=lambda c: c.strip("_").split("_")[0] != language)
    shown = list(dict.fromkeys(by_lower[c] for c in close))[:5]
    hint = f"close: {', '.join(shown)}" if shown else f"e.g. {', '.join(sorted(names.values())[:5])}"
    raise SeqgenError(
        f"{where}: not a language code of the model's tokenizer ({hint}; {len(names)} codes in all)"
    )
