"""``scripts/harness/profile_cpu_step.py`` on tiny models: a decode round is one call of the backend's ``step``, and
the operators land in the components that called them (the LM head apart from the layers' maps, attention, top-k,
the encoder or prefill apart from the rounds)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "scripts" / "harness"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(HARNESS))
    try:
        yield importlib.import_module("profile_cpu_step")
    finally:
        sys.path.remove(str(HARNESS))


@pytest.mark.parametrize(("family", "first_from_prefill"), [("bart", False), ("llama", True)])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_rounds_are_steps_and_each_part_lands_in_its_component(
    script, tiny_models, family: str, first_from_prefill: bool, dtype: str
) -> None:
    new = 4
    args = argparse.Namespace(model=tiny_models(family), beams=2, new_tokens=new, threads=1, target_lang=None)
    result = script.profile(args, dtype, ["a first line of text", "and a second one"])
    # a decoder-only's first token comes from its prefill's logits: one step fewer
    assert result["rounds"] == new - first_from_prefill
    ms = result["ms_per_round"]
    assert set(ms) == set(script.COMPONENTS)
    for part in ("decoder layers' linear maps", "LM head product", "attention: score and value products", "top-k"):
        assert ms[part] > 0, part
    assert result["encoder_or_prefill_ms"] > 0
    assert len(result["outputs"]) == 2


def test_an_operator_is_attributed_by_its_callers(script) -> None:
    """The rules on made-up stacks (innermost first), one per component they tell apart."""
    head = [("models/linear_maps.py", "__call__"), ("models/encoder_decoder.py", "logits")]
    layer = [("models/linear_maps.py", "__call__"), ("models/layers.py", "__call__")]
    attention = [("models/attention.py", "scores_of"), ("models/layers.py", "self_attention")]
    search = [("search/beam.py", "_accumulated_log_probs"), ("search/beam.py", "advance")]
    assert script.component("mkldnn::_linear_pointwise", head) == "LM head product"
    assert script.component("quantized::linear_dynamic", layer) == "decoder layers' linear maps"
    assert script.component("aten::copy_", head[:1] + head) == script.COMPONENTS[2]  # block copies
    assert script.component("aten::bmm", attention) == "attention: score and value products"
    assert script.component("aten::_to_copy", attention) == "attention: casts"
    assert script.component("aten::_softmax", attention) == "attention: softmax, scale, mask"
    assert script.component("aten::_to_copy", search) == "logits cast to float32"
    assert script.component("aten::_log_softmax", search) == "log-softmax, score add, processors"
    assert script.component("aten::topk", [("search/beam.py", "wide_topk")]) == "top-k"
    assert script.component("aten::copy_", [("models/kv_store.py", "write")]) == "cache writes"
    assert script.component("aten::mm", [("models/source.py", "encode")] + layer) is None
