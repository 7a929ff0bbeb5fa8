"""A shared prompt head (``DecoderOnlyBackend.share``, ``prompts.Prompter.head``): its keys and values computed once
per run and each prompt's own tokens prefilled over them give the whole prompt's keys, values and last logits (up to
float32 summation order), an input's bit for bit whatever its neighbours; a prompt that does not begin with the head
is prefilled whole beside the others."""

from __future__ import annotations

import pytest
import torch

from seqgen_cli.models import fast_backend
from seqgen_cli.models.decoder_only import DecoderOnlyBackend
from seqgen_cli.models.prefill import MIN_SHARED
from seqgen_cli.prompts import Prompter, PromptSettings
from seqgen_cli.search.protocol import Batch
from tests.tiny_models import V, decoder_only_model

# The head's K/V come from a forward of its own and the rest's from another over them: the same sums in another
# order (other product shapes, another key count), a few units of float32's last place per term.
SUMMATION = 1e-4
HEAD = list(range(3, 3 + MIN_SHARED + 3))
WIDTH = 32  # the batch's width bucket (a multiple of 8, as shapes.input_width makes it)
NAMES = ["gpt2", "llama", "llama-mqa", "mistral-window4", "qwen2-window3"]


@pytest.fixture(autouse=True)
def _inference():  # as the engine calls the backend: no autograd
    with torch.inference_mode():
        yield


def prompts(own: list[int], seed: int = 0, head: list[int] = HEAD) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [head + torch.randint(3, V, (n,), generator=g).tolist() for n in own]


def left_padded(rows: list[list[int]], width: int = WIDTH) -> Batch:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    return Batch(ids, mask)


def backend(name: str) -> DecoderOnlyBackend:
    torch.manual_seed(0)
    out = fast_backend(decoder_only_model(name))
    assert isinstance(out, DecoderOnlyBackend)
    return out


def real(kv: torch.Tensor, mask: torch.Tensor, i: int) -> torch.Tensor:
    """Row ``i``'s keys or values [Hkv, W, d] at its real columns."""
    return kv[i][:, mask[i].bool()]


@pytest.mark.parametrize("name", NAMES)
def test_over_the_head_gives_the_whole_prompts_keys_values_and_logits(name: str) -> None:
    dec = backend(name)
    batch = left_padded(prompts([1, 6, 11, 18]))
    keys, values, logits = dec.prefill.forward(batch)
    dec.share(HEAD)
    k2, v2, l2 = dec.prefill(batch)
    mask = batch.attention_mask
    for a, b in zip(keys + values, k2 + v2, strict=True):
        for i in range(mask.shape[0]):
            torch.testing.assert_close(real(b, mask, i), real(a, mask, i), rtol=SUMMATION, atol=SUMMATION)
    torch.testing.assert_close(l2, logits, rtol=SUMMATION, atol=SUMMATION * float(logits.abs().max()))
    assert dec.prefill.shared == {"tokens": len(HEAD), "prefills": 1, "inputs": 4}
    dec.prefill(left_padded(prompts([2, 3], seed=1)))
    assert dec.prefill.shared == {"tokens": len(HEAD), "prefills": 1, "inputs": 6}  # the head: once per run


@pytest.mark.parametrize("name", NAMES)
def test_an_inputs_prefill_over_the_head_does_not_depend_on_its_neighbours(name: str) -> None:
    dec = backend(name)
    dec.share(HEAD)
    rows = prompts([1, 6, 11, 18], seed=2)
    together = dec.prefill(left_padded(rows))
    for i, row in enumerate(rows):
        alone = dec.prefill(left_padded([row]))
        mask = left_padded([row]).attention_mask
        for a, b in zip(alone[0] + alone[1], together[0] + together[1], strict=True):
            assert torch.equal(real(a, mask, 0), real(b[i : i + 1], mask, 0)), (name, i)
        assert torch.equal(alone[2][0], together[2][i]), (name, i)


def test_a_prompt_without_the_head_is_prefilled_whole_beside_the_others() -> None:
    dec = backend("llama")
    rows = prompts([4, 9]) + prompts([5], head=[40] + HEAD[1:]) + [HEAD]  # another head; the head alone
    batch = left_padded(rows)
    keys, values, logits = dec.prefill.forward(batch)
    dec.share(HEAD)
    k2, v2, l2 = dec.prefill(batch)
    mask = batch.attention_mask
    for a, b in zip(keys + values, k2 + v2, strict=True):
        for i in range(len(rows)):
            torch.testing.assert_close(real(b, mask, i), real(a, mask, i), rtol=SUMMATION, atol=SUMMATION)
    torch.testing.assert_close(l2, logits, rtol=SUMMATION, atol=SUMMATION * float(logits.abs().max()))
    assert dec.prefill.shared["inputs"] == 2  # the two that begin with it and go on


def test_a_short_head_is_not_shared() -> None:
    dec = backend("gpt2")
    dec.share(HEAD[: MIN_SHARED - 1])
    batch = left_padded(prompts([3, 5], head=HEAD[: MIN_SHARED - 1]))
    assert dec.prefill.begins_with_head(batch) is None and dec.prefill.shared["tokens"] == 0


class Words:
    """A tokenizer of words (each word its own id), enough for ``Prompter``'s plain and templated prompts."""

    chat_template = None

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = True, **_: object) -> dict[str, list[int]]:
        ids = [self.vocab.setdefault(w, len(self.vocab) + 3) for w in text.split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_the_head_is_what_every_prompt_begins_with_less_its_last_token() -> None:
    words = Words()
    template = Prompter(PromptSettings(template="Translate these words into German, please. {lang} {input} Done."), words)
    head = template.head()
    assert head == [1, *(words.vocab[w] for w in "Translate these words into German,".split())]  # less "please."
    prompt = template._tokens(template.render("a cat", {"lang": "de"}))
    assert prompt[: len(head)] == head
    assert Prompter(PromptSettings(), words).head() == []  # the input alone: nothing shared
    assert Prompter(PromptSettings(template="{lang}: {input}"), words).head() == []  # a field first


def test_the_int8_backend_prefills_over_the_head_too() -> None:
    """``--dtype int8``: the prefill stays the model's float32 forward, the head shared as in float32."""
    torch.manual_seed(0)
    dec = fast_backend(decoder_only_model("llama"), int8=True)
    batch = left_padded(prompts([3, 12]))
    keys, _, logits = dec.prefill.forward(batch)
    dec.share(HEAD)
    k2, _, l2 = dec.prefill(batch)
    mask = batch.attention_mask
    for a, b in zip(keys, k2, strict=True):
        for i in range(mask.shape[0]):
            torch.testing.assert_close(real(b, mask, i), real(a, mask, i), rtol=SUMMATION, atol=SUMMATION)
    torch.testing.assert_close(l2, logits, rtol=SUMMATION, atol=SUMMATION * float(logits.abs().max()))
    assert dec.prefill.shared["prefills"] == 1 and dec.prefill.shared["inputs"] == 2
