"""The prompt tree (``models/prompt_tree.py``, ``Prefill.through_tree``): prompts with breaks prefilled segment by
segment, each segment's keys and values computed once per run for every prompt that has the same tokens up to its
end, give the whole prompt's keys, values and last logits (up to float32 summation order), an input's bit for bit
whatever its neighbours and whatever the tree held before; a prompt without breaks is prefilled whole beside the
others."""

from __future__ import annotations

import pytest
import torch

from seqgen_cli.models import fast_backend
from seqgen_cli.models.decoder_only import DecoderOnlyBackend
from seqgen_cli.models.prompt_tree import MIN_SEGMENT, PromptTree, segment_ends, segment_key
from seqgen_cli.search.protocol import Batch
from tests.tiny_models import V, decoder_only_model

# A segment's K/V come from a forward of its own over its prefix's: the whole prompt's sums in another order (other
# product shapes, another key count), a few units of float32's last place per term.
SUMMATION = 1e-4
NAMES = ["gpt2", "llama", "llama-mqa", "mistral-window4", "qwen2-window3"]
A, B = 20, 24  # two shared parts' lengths (each at least MIN_SEGMENT)


@pytest.fixture(autouse=True)
def _inference():  # as the engine calls the backend: no autograd
    with torch.inference_mode():
        yield


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM, EXAMPLES, OTHER = tokens(A, 1), tokens(B, 2), tokens(A, 3)


def conversation(own: int, seed: int, parts: tuple[list[int], ...] = (SYSTEM, EXAMPLES)) -> tuple[list[int], list[int]]:
    """A prompt of ``parts`` then ``own`` tokens of its own, with a break after each part."""
    ids, breaks = [], []
    for part in parts:
        ids += part
        breaks.append(len(ids))
    return ids + tokens(own, 100 + seed), breaks


def left_padded(rows: list[tuple[list[int], list[int]]], width: int | None = None) -> Batch:
    width = width or -(-max(len(ids) for ids, _ in rows) // 8) * 8
    k = max(len(b) for _, b in rows) or 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    breaks = torch.zeros(len(rows), k, dtype=torch.long)
    for i, (row, br) in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
        breaks[i, : len(br)] = torch.tensor(br, dtype=torch.long)
    return Batch(ids, mask, breaks=breaks)


def backend(name: str, int8: bool = False) -> DecoderOnlyBackend:
    torch.manual_seed(0)
    out = fast_backend(decoder_only_model(name), int8=int8)
    assert isinstance(out, DecoderOnlyBackend)
    return out


def real(kv: torch.Tensor, mask: torch.Tensor, i: int) -> torch.Tensor:
    """Row ``i``'s keys or values [Hkv, W, d] at its real columns."""
    return kv[i][:, mask[i].bool()]


def assert_whole(dec: DecoderOnlyBackend, batch: Batch, got: tuple, parts: str = "kv") -> None:
    """``got`` (a prefill of ``batch``) is the whole prompts' forward, up to summation order."""
    keys, values, logits = dec.prefill.forward(batch)
    mask = batch.attention_mask
    want = (keys if "k" in parts else []) + (values if "v" in parts else [])
    have = (got[0] if "k" in parts else []) + (got[1] if "v" in parts else [])
    for a, b in zip(want, have, strict=True):
        for i in range(mask.shape[0]):
            torch.testing.assert_close(real(b, mask, i), real(a, mask, i), rtol=SUMMATION, atol=SUMMATION)
    torch.testing.assert_close(got[2], logits, rtol=SUMMATION, atol=SUMMATION * float(logits.abs().max()))


@pytest.mark.parametrize("name", NAMES)
def test_through_the_tree_gives_the_whole_prompts_keys_values_and_logits(name: str) -> None:
    dec = backend(name)
    rows = [conversation(n, i) for i, n in enumerate([1, 6, 11, 18])]  # one system turn, one set of examples
    rows += [conversation(5, 9, (SYSTEM,)), conversation(7, 10, (OTHER, EXAMPLES))]  # shallower; another root
    batch = left_padded(rows)
    assert_whole(dec, batch, dec.prefill(batch))
    tree = dec.prefill.tree
    assert tree is not None
    # computed: SYSTEM, SYSTEM+EXAMPLES, OTHER, OTHER+EXAMPLES and the six prompts' own last segments
    assert tree.stats["segments"] == 4 + len(rows), tree.stats
    # reused within the batch: SYSTEM by four more prompts, SYSTEM+EXAMPLES by three more
    assert tree.stats["saved"] == 4 * A + 3 * B and tree.stats["shared"] == 2, tree.stats
    dec.prefill(left_padded([conversation(3, 20), conversation(4, 21, (OTHER, EXAMPLES))]))
    assert tree.stats["segments"] == 4 + len(rows) + 2, "a later batch computes only its own tokens"
    assert tree.stats["saved"] == 4 * A + 3 * B + 2 * (A + B) and tree.stats["shared"] == 4, tree.stats


@pytest.mark.parametrize("name", NAMES)
def test_an_inputs_prefill_through_the_tree_does_not_depend_on_its_neighbours_or_the_tree(name: str) -> None:
    rows = [conversation(n, i + 30) for i, n in enumerate([1, 6, 11, 18])] + [conversation(9, 40, (OTHER,))]
    together = backend(name).prefill(left_padded(rows))
    warm = backend(name)  # a tree that already holds the shared segments (computed for other prompts)
    warm.prefill(left_padded([conversation(2, 50), conversation(3, 51, (OTHER,))]))
    for i, row in enumerate(rows):
        for dec in (backend(name), warm):
            alone, n = dec.prefill(left_padded([row])), len(row[0])
            for a, b in zip(alone[0] + alone[1], together[0] + together[1], strict=True):
                assert torch.equal(a[0, :, -n:], b[i, :, -n:]), (name, i)
            assert torch.equal(alone[2][0], together[2][i]), (name, i)


def test_a_prompt_without_breaks_is_prefilled_whole_beside_the_others() -> None:
    dec = backend("llama")
    plain = (SYSTEM + tokens(7, 60), [])
    short = (tokens(MIN_SEGMENT - 1, 61) + tokens(6, 62), [MIN_SEGMENT - 1])  # its break too near the start
    convo = conversation(4, 63)
    once = (convo[0], [A + B])  # the same tokens with one break: other segments
    rows = [convo, plain, short, conversation(9, 64), once]
    batch = left_padded(rows)
    assert dec.prefill.splits(batch) == [True, False, False, True, True]
    assert_whole(dec, batch, dec.prefill(batch))
    assert dec.prefill.tree.stats["segments"] == 2 + 2 + 2  # SYSTEM, SYSTEM+EXAMPLES, two own; once's two


def test_the_int8_backend_prefills_through_the_tree_too() -> None:
    """``--dtype int8``: the prefill stays the model's float32 forward, through the tree as in float32."""
    dec = backend("llama", int8=True)
    batch = left_padded([conversation(3, 70), conversation(12, 71)])
    assert_whole(dec, batch, dec.prefill(batch), parts="k")
    assert dec.prefill.tree.stats["saved"] == A + B


def test_segments_keep_breaks_at_least_min_segment_apart_and_short_of_the_end() -> None:
    m = MIN_SEGMENT
    assert segment_ends(100, []) == [100]
    assert segment_ends(100, [0, m - 1]) == [100]  # none kept: too near the start
    assert segment_ends(100, [m, m + 3, 2 * m + 1, 100]) == [m, 2 * m + 1, 100]  # one too near; the end is no break
    assert segment_ends(2 * m, [m + 1, m]) == [m, 2 * m]  # in any order, once each


def test_the_tree_keeps_its_budget_dropping_the_least_recently_used_and_deeper_segments_first() -> None:
    seg = torch.zeros(1, 2, 1, 10, 2)  # [L, 2, Hkv, s, d]: 160 bytes
    tree = PromptTree(budget=3 * seg.nbytes)
    prompt, ends = list(range(40)), [10, 20, 30, 40]
    for j in range(3):
        tree.computed(segment_key(prompt, ends, j), seg.clone(), keep=True)
    assert len(tree.chain(prompt, ends)) == 3
    assert len(tree.chain(prompt, [10, 15, 30, 40])) == 1, "the same tokens split otherwise: other segments"
    tree.computed(segment_key([99] * 10, [10], 0), seg.clone(), keep=True)  # over budget: the deepest goes
    assert len(tree.chain(prompt, ends)) == 2 and tree.nbytes == 3 * seg.nbytes
    tree.computed(segment_key([98] * 10, [10], 0), seg.clone(), keep=False)  # a prompt's last: counted, not kept
    assert tree.stats["segments"] == 5 and tree.nbytes == 3 * seg.nbytes
    for _ in range(4):  # a segment kept below its dropped parent, computed again: counted once
        tree.computed(segment_key(prompt, ends, 1), seg.clone(), keep=True)
    assert tree.nbytes == 3 * seg.nbytes == sum(kv.nbytes for kv in tree.kept.values())
