"""A checkpoint folder as transformers reads it, and what seqgen refuses of it (``checkpoint.py``): a checkpoint's
own code never runs and nothing asks on stdin; no weight file outside the folder is read; no output overwrites a
file of the checkpoint; a missing weight is an error, not random values; the own loader reads the files and ties
transformers reads; the digests of ``--resume`` cover exactly the files that loaded, as they were when they loaded;
a damaged digest cache is hashed again, never trusted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from seqgen_cli import checkpoint, digests
from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import Generator
from seqgen_cli.models import own_model
from tests.helpers import one_line_error, run_seqgen, seqgen, write_lines
from tests.tiny_models import sample_texts

MARKER = "MARKER"  # the file a checkpoint's own code writes when it runs


def copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def edit_config(folder: Path, **fields: object) -> None:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")


def code_writing_marker(folder: Path, *modules: str) -> Path:
    """Python files in ``folder`` that, when imported, write ``folder/MARKER``."""
    for name in modules:
        (folder / f"{name}.py").write_text(
            f"from pathlib import Path\nPath(__file__).with_name({MARKER!r}).write_text('ran')\n", encoding="utf-8"
        )
    return folder / MARKER


# -- item 0: flan-t5's own head -----------------------------------------------------------------------------


def test_flan_t5_with_its_own_head_gives_generate_tokens_on_the_default_path(tiny_models, tmp_path: Path) -> None:
    """The tiny flan-t5 is saved as flan-t5-base is (``tie_word_embeddings: false``, its own ``lm_head.weight``):
    the CPU's default path (own tree, t5 decoder) gives ``--backend hf``'s lines."""
    model = tiny_models("flan-t5")
    assert "lm_head.weight" in load_file(str(model / "model.safetensors"))
    src = write_lines(tmp_path / "in.txt", sample_texts(4, seed=11))
    outs = {}
    for backend in ("auto", "hf"):
        out, stats = tmp_path / f"{backend}.txt", tmp_path / f"{backend}.json"
        res = seqgen("generate", "-m", str(model), str(src), "-o", str(out), "--backend", backend,
                     "--max-new-tokens", "12", "--stats", str(stats), "-q")  # fmt: skip
        assert res.exit_code == 0, res.stderr
        outs[backend] = out.read_text(encoding="utf-8")
        if backend == "auto":
            device = json.loads(stats.read_text())["device"]
            assert device["loader"] == "seqgen" and device["engine"] == "t5 decoder"
    assert outs["auto"] == outs["hf"]


# -- item 1: a checkpoint's code never runs -----------------------------------------------------------------


@pytest.fixture
def custom_code(tiny_models, tmp_path: Path) -> tuple[Path, Path]:
    """A gpt2 checkpoint whose config names a model type transformers does not have, with ``auto_map`` to Python
    files beside it that write a marker when imported."""
    folder = copy(tiny_models("gpt2"), tmp_path / "custom")
    marker = code_writing_marker(folder, "configuration_probe", "modeling_probe")
    edit_config(folder, model_type="seqgen_probe", auto_map={
        "AutoConfig": "configuration_probe.ProbeConfig", "AutoModelForCausalLM": "modeling_probe.ProbeModel",
    })  # fmt: skip
    return folder, marker


@pytest.mark.parametrize("where", ["stdin", "file"])
def test_checkpoint_code_is_refused_before_any_input_is_read(custom_code, tmp_path: Path, where: str) -> None:
    """Inputs that answer transformers' "run the custom code? [y/N]" with yes: one line, nothing runs, nothing
    on stdout, exit 2; from a file and from stdin, in a process of its own (a real stdin)."""
    folder, marker = custom_code
    lines = "y\nyes\n1\n"
    src = tmp_path / "in.txt"
    src.write_text(lines, encoding="utf-8")
    args = ["generate", "-m", str(folder), *([str(src)] if where == "file" else [])]
    res = run_seqgen(*args, input=lines.encode() if where == "stdin" else None, timeout=120)
    err = res.stderr.decode().strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr.decode()
    assert "own Python code" in err[0] and "configuration_probe.ProbeConfig" in err[0], err[0]
    assert res.stdout == b"" and not marker.exists()


def test_checkpoint_code_is_refused_on_every_path_that_loads(custom_code, tmp_path: Path) -> None:
    """The Python API (and so the workers, --verify, bench's seqgen) and `seqgen bench` refuse it too."""
    folder, marker = custom_code
    with pytest.raises(SeqgenError, match="own Python code"):
        Generator(str(folder))
    src = write_lines(tmp_path / "in.txt", ["a line"])
    res = seqgen("bench", str(src), "-m", str(folder), "--out", str(tmp_path / "bench"))
    one_line_error(res, "own Python code")
    assert not marker.exists()


def test_auto_map_beside_a_model_type_transformers_has_runs_transformers_class(tiny_models, tmp_path: Path) -> None:
    """``auto_map`` in a checkpoint of a model type transformers has (as Phi-3's have): transformers' own class
    runs (``trust_remote_code=False``), the checkpoint's code does not, and the outputs are the plain ones."""
    folder = copy(tiny_models("gpt2"), tmp_path / "gpt2")
    marker = code_writing_marker(folder, "modeling_probe")
    edit_config(folder, auto_map={"AutoModelForCausalLM": "modeling_probe.ProbeModel"})
    src = write_lines(tmp_path / "in.txt", sample_texts(2, seed=3))
    res = seqgen("generate", "-m", str(folder), str(src), "--max-new-tokens", "4", "-q", input="y\n")
    plain = seqgen("generate", "-m", str(tiny_models("gpt2")), str(src), "--max-new-tokens", "4", "-q")
    assert res.exit_code == 0 and res.stdout == plain.stdout and not marker.exists()


def test_tokenizer_code_is_refused(tiny_models, tmp_path: Path) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "tok")
    marker = code_writing_marker(folder, "tokenization_probe")
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings.update(tokenizer_class="ProbeTokenizer", auto_map={"AutoTokenizer": ["tokenization_probe.ProbeTokenizer", None]})
    path.write_text(json.dumps(settings), encoding="utf-8")
    src = write_lines(tmp_path / "in.txt", ["y"])
    one_line_error(seqgen("generate", "-m", str(folder), str(src)), "tokenizer_config.json", "own Python code")
    with pytest.raises(SeqgenError, match="tokenizer_config.json"):
        Generator(str(folder))
    assert not marker.exists()


# -- item 2: weights from outside the folder ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["relative", "absolute", "transformers_weights"])
@pytest.mark.parametrize("backend", ["auto", "hf"])
def test_a_weight_file_outside_the_folder_is_refused(tiny_models, tmp_path: Path, how: str, backend: str) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "ckpt" / "model")
    outside = tmp_path / "x.safetensors"
    os.replace(folder / "model.safetensors", outside)
    name = "../../x.safetensors" if how != "absolute" else str(outside)
    if how == "transformers_weights":
        edit_config(folder, transformers_weights=name)
    else:
        keys = load_file(str(outside)).keys()
        index = {"metadata": {}, "weight_map": dict.fromkeys(keys, name)}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    src = write_lines(tmp_path / "in.txt", ["a line"])
    res = seqgen("generate", "-m", str(folder), str(src), "--backend", backend)
    one_line_error(res, "outside the checkpoint folder", name)
    assert res.stdout == ""
    with pytest.raises(SeqgenError, match="outside the checkpoint folder"):
        Generator(str(folder), backend=backend)


# -- item 3: an output over a file of the checkpoint --------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors"])
def test_an_output_over_a_file_of_the_checkpoint_is_refused(tiny_models, tmp_path: Path, name: str) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    before = (folder / name).read_bytes()
    src = write_lines(tmp_path / "in.txt", ["a line"])
    res = seqgen("generate", "-m", str(folder), str(src), "-o", str(folder / name))
    one_line_error(res, f"the model's {name}", "would destroy")
    assert (folder / name).read_bytes() == before


# -- item 4: no weight invented -----------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["fc1", "untied head"])
@pytest.mark.parametrize("backend", ["auto", "hf"])
def test_a_missing_weight_is_an_error_naming_it(tiny_models, tmp_path: Path, what: str, backend: str) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    if what == "fc1":
        gone = "model.decoder.layers.0.fc1.weight"
    else:  # the head untied, and not in the file
        gone = "lm_head.weight"
        edit_config(folder, tie_word_embeddings=False)
    tensors.pop(gone, None)
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    src = write_lines(tmp_path / "in.txt", ["a line"])
    one_line_error(seqgen("generate", "-m", str(folder), str(src), "--backend", backend), gone, "model.safetensors")


# -- item 5: the files and ties transformers reads ----------------------------------------------------------


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in model.state_dict().items()}


def assert_as_transformers(folder: Path) -> None:
    own, why = own_model.load(str(folder), tf.AutoConfig.from_pretrained(folder))
    assert own is not None, why
    ref = tf.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    mine, theirs = state(own), state(ref)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], t) for k, t in theirs.items())


def other_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v + 1 if v.is_floating_point() else v for k, v in load_file(str(folder / "model.safetensors")).items()}


def test_transformers_weights_in_the_config_is_the_file_read(tiny_models, tmp_path: Path) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    save_file(other_weights(folder), str(folder / "other.safetensors"), {"format": "pt"})
    edit_config(folder, transformers_weights="other.safetensors")
    assert checkpoint.weight_files(folder) == [folder / "other.safetensors"]
    assert_as_transformers(folder)


def test_a_single_file_beside_an_index_is_the_file_read(tiny_models, tmp_path: Path) -> None:
    """transformers takes ``model.safetensors`` before an index; so does the own loader, and the digests."""
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    weights = other_weights(folder)
    save_file(weights, str(folder / "shard.safetensors"), {"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "shard.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    assert checkpoint.weight_files(folder) == [folder / "model.safetensors"]
    names = [checkpoint.relative(folder, p) for p in checkpoint.read_files(folder)]
    assert "model.safetensors" in names and "shard.safetensors" not in names
    assert "model.safetensors.index.json" not in names
    assert_as_transformers(folder)


# -- items 6, 7: the digests are of the files that loaded ---------------------------------------------------


def test_shards_in_a_subfolder_and_a_bin_beside_an_adapter_are_digested(tiny_models, tmp_path: Path) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    (folder / "shards").mkdir()
    save_file(weights, str(folder / "shards" / "part-1.safetensors"), {"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "shards/part-1.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    first = digests.folder_digests(folder)
    assert {"model.safetensors.index.json", "shards/part-1.safetensors"} <= set(first)
    save_file({k: v + 1 for k, v in weights.items()}, str(folder / "shards" / "part-1.safetensors"), {"format": "pt"})
    assert digests.folder_digests(folder)["shards/part-1.safetensors"] != first["shards/part-1.safetensors"]

    adapter = copy(tiny_models("bart"), tmp_path / "adapter")
    torch.save(load_file(str(adapter / "model.safetensors")), adapter / "pytorch_model.bin")
    os.replace(adapter / "model.safetensors", adapter / "adapter_model.safetensors")
    names = set(digests.folder_digests(adapter))
    assert "pytorch_model.bin" in names and "adapter_model.safetensors" not in names  # what transformers loads


def test_a_weight_file_replaced_while_the_model_loads_is_an_error(
    tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is saved anew during the load: the run stops with one line instead of journaling outputs of the
    old weights under the new file's digest."""
    import safetensors.torch

    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    real = safetensors.torch.load_file

    def load_then_replace(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        tensors = real(path, *args, **kwargs)
        save_file(other_weights(folder), str(folder / "new.safetensors"), {"format": "pt"})
        os.replace(folder / "new.safetensors", folder / "model.safetensors")
        return tensors

    monkeypatch.setattr(safetensors.torch, "load_file", load_then_replace)
    src = write_lines(tmp_path / "in.txt", ["a line"])
    out = tmp_path / "out.txt"
    one_line_error(seqgen("generate", "-m", str(folder), str(src), "-o", str(out)), "model.safetensors", "changed")
    assert not out.exists() or out.read_text() == ""


def test_digests_are_of_the_files_as_they_loaded(tiny_models, tmp_path: Path) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    loaded = checkpoint.snapshot(folder)
    assert set(digests.folder_digests(folder, loaded)) == set(loaded)
    save_file(other_weights(folder), str(folder / "new.safetensors"), {"format": "pt"})
    os.replace(folder / "new.safetensors", folder / "model.safetensors")
    with pytest.raises(SeqgenError, match="changed since the model loaded"):
        digests.folder_digests(folder, loaded)


# -- item 8: the digest cache -------------------------------------------------------------------------------


@pytest.fixture
def small_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}", encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_a_cache_folder_that_is_a_file_is_skipped(small_folder: Path, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "digests").write_text("not a folder", encoding="utf-8")
    monkeypatch.setenv("SEQGEN_CACHE", str(cache))
    digests._memo.clear()
    assert digests.folder_digests(small_folder)["model.safetensors"] == digests.hashlib.sha256(b"weights").hexdigest()


def test_a_damaged_cache_entry_is_hashed_again(small_folder: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEQGEN_CACHE", str(tmp_path / "cache"))
    digests._memo.clear()
    right = digests.folder_digests(small_folder)
    (entry,) = [p for p in (tmp_path / "cache" / "digests").iterdir()
                if json.loads(p.read_text())["path"].endswith("model.safetensors")]  # fmt: skip
    record = json.loads(entry.read_text())
    flipped = record["sha256"][:-1] + ("0" if record["sha256"][-1] != "0" else "1")
    entry.write_text(json.dumps({**record, "sha256": flipped}))
    digests._memo.clear()
    assert digests.folder_digests(small_folder) == right


def test_a_full_disk_leaves_no_file_in_the_cache(small_folder: Path, tmp_path: Path, monkeypatch) -> None:
    import errno

    monkeypatch.setenv("SEQGEN_CACHE", str(tmp_path / "cache"))
    digests._memo.clear()
    real = Path.write_text

    def full(self: Path, text: str, *args, **kwargs) -> int:  # noqa: ANN002, ANN003
        real(self, text[: len(text) // 2], *args, **kwargs)  # what fitted
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    assert digests.folder_digests(small_folder)["model.safetensors"] == digests.hashlib.sha256(b"weights").hexdigest()
    monkeypatch.undo()
    assert list((tmp_path / "cache" / "digests").iterdir()) == []


# -- item 10: errors that name the file at fault ------------------------------------------------------------


def transpose_fc1(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    key = "model.decoder.layers.0.fc1.weight"
    tensors[key] = tensors[key].t().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})


@pytest.mark.parametrize("fault", ["transposed weight", "d_model"])
def test_weights_that_do_not_fit_the_config_name_the_file_and_weight(tiny_models, tmp_path: Path, fault: str) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    if fault == "transposed weight":
        transpose_fc1(folder)
    else:
        edit_config(folder, d_model=48)
    src = write_lines(tmp_path / "in.txt", ["a line"])
    line = one_line_error(seqgen("generate", "-m", str(folder), str(src)), "model.safetensors holds", "config.json")
    if fault == "transposed weight":
        assert "model.decoder.layers.0.fc1.weight as [32, 64]" in line


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "index"])
def test_a_json_file_that_is_not_json_is_named(tiny_models, tmp_path: Path, name: str) -> None:
    """A bad generation_config.json is not skipped (the run would use the library's defaults)."""
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    if name == "index":
        name = "model.safetensors.index.json"
        os.replace(folder / "model.safetensors", folder / "shard.safetensors")
    (folder / name).write_text("{not json", encoding="utf-8")
    src = write_lines(tmp_path / "in.txt", ["a line"])
    one_line_error(seqgen("generate", "-m", str(folder), str(src)), f"{name} is not valid JSON")


def test_a_tokenizer_json_without_a_model_is_named(tiny_models, tmp_path: Path) -> None:
    folder = copy(tiny_models("bart"), tmp_path / "ckpt")
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    (folder / "tokenizer.json").write_text(json.dumps({**data, "model": None}), encoding="utf-8")
    src = write_lines(tmp_path / "in.txt", ["a line"])
    one_line_error(seqgen("generate", "-m", str(folder), str(src)), "tokenizer.json holds no tokenizer model")


def test_a_ctranslate2_model_folder_is_named_as_one(tmp_path: Path) -> None:
    """``-m`` given a CTranslate2 conversion (model.bin, shared_vocabulary.json, a config.json without
    model_type): one line saying what it is and what seqgen reads (before: transformers' "Should have a
    model_type key")."""
    from tests.helpers import one_line_error, seqgen

    ct2 = tmp_path / "opus-mt-ct2"
    ct2.mkdir()
    (ct2 / "model.bin").write_bytes(b"\0" * 16)
    (ct2 / "shared_vocabulary.json").write_text('["<s>", "</s>"]', encoding="utf-8")
    (ct2 / "config.json").write_text('{"add_source_bos": false, "decoder_start_token": "</s>"}', encoding="utf-8")
    src = tmp_path / "in.txt"
    src.write_text("a line\n", encoding="utf-8")
    one_line_error(seqgen("generate", "-m", str(ct2), str(src)), "is a CTranslate2 model", "Hugging Face checkpoint")
