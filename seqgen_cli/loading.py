"""Load a checkpoint (local folder, or a hub id where a hub is reachable) with clear one-line errors."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import pickle
import re
import socket
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from seqgen_cli import checkpoint, startup
from seqgen_cli.digests import checkpoint_folder
from seqgen_cli.errors import SeqgenError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OWN_DTYPES = (torch.float32, torch.bfloat16)  # seqgen's own trees load in these (int8: float32, quantized after)
INT8 = (
    "int8"  # float32 weights, linear layers run int8 (dynamic quantization, CPU only): models/linear_maps.py
)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt() parameters (malloc.h)


@dataclass
class Loaded:
    """A model ready to generate: weights on the device, tokenizer set up for batching."""

    model: torch.nn.Module
    tokenizer: object
    is_encoder_decoder: bool
    device: torch.device
    dtype: torch.dtype  # of the loaded weights (float32 for int8)
    int8: bool = False  # --dtype int8: the Generator quantizes the linear layers before the first batch
    name: str = ""  # as given
    source: str = ""  # the folder or hub name it was read from
    loader: str = "transformers"  # what built ``model``: "seqgen" (models/own_model.py) or "transformers (<why>)"
    files: dict[str, checkpoint.StatKey] | None = None  # the checkpoint's files as they loaded (``--resume``'s digests)
    _reference: torch.nn.Module | None = None

    @property
    def own(self) -> bool:
        """Whether ``model`` is seqgen's own module tree (``models/own_model.py``), not transformers' model."""
        from seqgen_cli.models.tree import OwnSeq2Seq

        return isinstance(self.model, OwnSeq2Seq)

    def use_reference(self) -> torch.nn.Module:
        """From now on ``model`` is transformers' (``--backend hf``, or ``auto`` picking ``generate()``)."""
        if self.own:
            self.model, self.loader = self.reference, "transformers (generate() runs it)"
        return self.model

    @property
    def reference(self) -> torch.nn.Module:
        """transformers' model of the checkpoint, which ``generate()`` runs: ``model``, or where that is seqgen's
        own tree, transformers' loaded now (once), in its dtype on the CPU."""
        if not self.own:
            return self.model
        if self._reference is None:
            model_type = self.model.config.model_type
            self._reference = transformers_model(self.name, self.source, model_type, True, self.dtype).eval()
        return self._reference

    @property
    def dtype_name(self) -> str:
        """``float32``, ``bfloat16``, ... or ``int8``."""
        return "int8" if self.int8 else str(self.dtype).removeprefix("torch.")

    def describe(self) -> dict[str, str]:
        return {"device": str(self.device), "dtype": self.dtype_name, "loader": self.loader}

    def gpu_memory(self) -> dict[str, Any]:
        """On CUDA: the GPU's name and peak memory (``torch.cuda.max_memory_allocated`` since the start or the last
        ``reset_peak_memory_stats``, MiB); else nothing."""
        if self.device.type != "cuda":
            return {}
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        return {"device_name": torch.cuda.get_device_name(self.device), "peak_gpu_memory_mb": round(peak, 1)}


def resolve_device(device: str | None) -> torch.device:
    """``None``/``auto`` = the first CUDA device if there is one, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise SeqgenError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SeqgenError(f"--device {device}: no CUDA device is available on this machine")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """``auto`` = float32 on CPU; bfloat16 on a GPU that supports it, else float16. ``int8`` loads float32
    (CPU only: a one-line error on a GPU)."""
    if dtype == INT8:
        if device.type != "cpu":
            raise SeqgenError(
                f"--dtype int8 runs on the CPU only (dynamic int8 quantization), not on {device}; "
                "use --device cpu, or --dtype float16/bfloat16 on a GPU"
            )
        return torch.float32
    if dtype in (None, "auto"):
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DTYPES[dtype]


def _int8_device(device: str | None) -> torch.device:
    """The device for ``--dtype int8``: the CPU for ``auto``; any other device is the int8 error (before
    asking whether it exists)."""
    if device in (None, "auto"):
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        return resolve_device(device)  # its one-line error
    resolve_dtype(INT8, dev)  # raises off the CPU
    return dev


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub's host resolves and accepts a connection within ``timeout`` seconds."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or ""
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(result and result[0])


def resolve_model_path(name: str) -> str:
    """A local checkpoint folder as given, a cached or reachable hub id, or a one-line error."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SeqgenError(f"model {name}: not a folder (pass a checkpoint folder with config.json)")
        if not (path / "config.json").is_file():
            raise SeqgenError(f"model {name}: not a checkpoint folder (no config.json in it)")
        return str(path)
    looks_like_path = (
        name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep in name.replace("/", "")
    )
    if looks_like_path:
        raise SeqgenError(f"model folder {name} does not exist")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, local_files_only=True, trust_remote_code=False)
        return name  # in the local hub cache
    except (OSError, ValueError):
        pass
    if not _hub_reachable():
        raise SeqgenError(
            f"model {name!r} is not a local folder and the model hub cannot be reached (offline); "
            "download the checkpoint where there is internet and pass its folder: -m /path/to/checkpoint"
        )
    return name


def load(name: str, device: str | None = None, dtype: str | None = None, own: bool = False) -> Loaded:
    """Load tokenizer and model (``AutoModelForSeq2SeqLM`` or ``AutoModelForCausalLM``), eval mode; each part a
    start-up stage (``--stats`` ``startup``). ``own``: for the fast engine on the CPU in float32, bfloat16 or int8, an
    encoder-decoder checkpoint of a family with a tree of its own (BART family, T5, mT5, UMT5, T5Gemma) as that tree where it
    reads it exactly (``models/own_model.py``; no transformers model class is imported), transformers' model
    otherwise."""
    with startup.stage("import transformers"):
        from transformers import AutoConfig, AutoTokenizer
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        )

    quiet_transformers()
    source = resolve_model_path(name)
    dev = _int8_device(device) if dtype == INT8 else resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    folder = checkpoint_folder(source)
    if folder is not None:  # before transformers reads a file of it
        checkpoint.refuse_code(folder, name)
        checkpoint.check_json_files(folder, name)
        files = checkpoint.snapshot(folder, name)  # refuses a weight file outside the folder
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as err:
        raise SeqgenError(f"model {name}: cannot read its config: {_first_line(err)}") from None
    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        is_encoder_decoder = True
    elif model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        is_encoder_decoder = False
    else:
        raise SeqgenError(
            f"model {name}: architecture {model_type!r} is not a text-generation model transformers can load "
            "(need a sequence-to-sequence or causal language model)"
        )
    expected = tokenizer_files(Path(source), model_type) if Path(source).is_dir() else []
    present = [f for f in expected if (Path(source) / f).is_file()]
    if expected and not present:  # transformers would build an empty tokenizer: empty or no outputs
        raise SeqgenError(
            f"model {name}: no tokenizer files in the folder (missing {', '.join(expected)}); "
            "copy them from the checkpoint the model comes from"
        )
    try:
        with startup.stage("tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        missing = [f for f in expected if f not in present]
        absent = f" (missing {', '.join(missing)})" if missing else ""
        raise SeqgenError(f"model {name}: cannot load its tokenizer{absent}: {_first_line(err)}") from None
    model, loader = None, "transformers"
    if own and is_encoder_decoder and not (dev.type == "cpu" and torch_dtype in OWN_DTYPES):  # the trees' reach
        here = f"{dev.type} {str(torch_dtype).removeprefix('torch.')}"
        loader = f"transformers (seqgen's own trees run on the CPU in float32, bfloat16 and int8, not {here})"
    elif own and is_encoder_decoder:
        from seqgen_cli.models import own_model

        with startup.stage("weights"):
            model, why = own_model.load(source, config, torch_dtype)
        loader = "seqgen" if model is not None else f"transformers ({why})"
    if model is None:
        model = transformers_model(name, source, model_type, is_encoder_decoder, torch_dtype)
    if folder is not None:  # the bytes that loaded are the bytes the digests will be of
        checkpoint.check_unchanged(folder, files, name)
    model.to(dev).eval()
    if dev.type == "cpu":
        keep_freed_memory()
    if not is_encoder_decoder:
        tokenizer.padding_side = "left"  # generation continues at the right edge of every row
    if tokenizer.pad_token_id is None:
        eos = model.generation_config.eos_token_id
        tokenizer.pad_token_id = eos[0] if isinstance(eos, list) else eos
    int8 = dtype == INT8
    loaded = Loaded(model, tokenizer, is_encoder_decoder, dev, torch_dtype, int8, name=name, source=source, loader=loader)
    loaded.files = files if folder is not None else None
    return loaded



def transformers_model(
    name: str, source: str, model_type: str, is_encoder_decoder: bool, dtype: torch.dtype
) -> torch.nn.Module:
    """transformers' model of the checkpoint (``AutoModelForSeq2SeqLM`` / ``AutoModelForCausalLM``), on the CPU, or
    the one-line error of weights it cannot load."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    auto = AutoModelForSeq2SeqLM if is_encoder_decoder else AutoModelForCausalLM
    names = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES if is_encoder_decoder else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    with startup.stage("model class import"):  # transformers imports a model's module on first use
        getattr(transformers, names[model_type], None)
    try:
        with fast_sinusoids(model_type), startup.stage("weights"):
            model, info = auto.from_pretrained(
                source, dtype=dtype, trust_remote_code=False, output_loading_info=True, ignore_mismatched_sizes=True
            )  # a mismatch is reported here, naming the weight, rather than by transformers' table
    except Exception as err:  # noqa: BLE001 - safetensors, pickle and torch each raise their own
        raise SeqgenError(weights_error(name, source, err)) from None
    for key, *shapes in info.get("mismatched_keys") or ():
        held, wanted = (list(shape) for shape in shapes[:2]) if len(shapes) >= 2 else ("?", "?")
        raise SeqgenError(
            f"model {name}: {checkpoint.file_of(Path(source), key)} holds {key} as {held} where config.json gives "
            f"{wanted}: the weights do not fit the config"
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers would fill them with random values: two runs would differ
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise SeqgenError(
            f"model {name}: its weights{weight_names(source)} lack {missing[0]}{more}; seqgen does not invent "
            "weights: use a complete checkpoint"
        )
    return model


def weight_names(source: str) -> str:
    """`` (model.safetensors)``: the weight files ``from_pretrained`` reads from the folder, or nothing."""
    try:
        files = [checkpoint.relative(Path(source), p) for p in checkpoint.weight_files(Path(source))]
    except (SeqgenError, OSError):
        files = []
    return f" ({', '.join(files)})" if files and Path(source).is_dir() else ""


def weights_error(name: str, source: str, err: Exception) -> str:
    """One line for weights that cannot be loaded, naming the file where the folder shows which."""
    where = weight_names(source)
    if isinstance(err, pickle.UnpicklingError):
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f" ({refused.group(1)})" if refused else ""
        return (
            f"model {name}: its weights{where} hold Python objects besides tensors{what}, which seqgen does not "
            "run (torch.load weights_only); convert the checkpoint to safetensors where it is trusted"
        )
    return f"model {name}: cannot load its weights{where}: {type(err).__name__}: {_first_line(err)}"


def source_limit(config: Any, tokenizer: Any, requested: int | None, new_tokens: int = 0) -> int | None:
    """The longest input the model takes: the smaller of the request and the model's position limit, less the
    ``new_tokens`` a decoder-only model generates after it.

    A model without a position limit (T5's relative positions) takes the request as given, by default the
    tokenizer's ``model_max_length`` where that is a real number (not transformers' ``int(1e30)`` for "no
    limit"), so one huge line is truncated (and counted) instead of asking for any amount of memory.
    """
    limit = context_length(config)
    if limit is None:
        if requested is not None:
            return requested
        tokenizer_limit = getattr(tokenizer, "model_max_length", None)
        real = isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < 10**9  # 1e30: none set
        limit = tokenizer_limit if real else None
    if limit is not None and new_tokens:
        limit = max(1, limit - new_tokens)
    if requested is None:
        return limit
    return min(requested, limit) if limit else requested


def context_length(config: Any) -> int | None:
    """The model's positions (``max_position_embeddings`` or its other names; LED: its encoder's 16,384), or
    ``None`` where it has no hard limit (relative positions) or says none."""
    from seqgen_cli.models.families import source_limited

    if not source_limited(config):
        return None
    keys = ("max_position_embeddings", "max_encoder_position_embeddings", "n_positions")
    return next((v for k in keys if (v := getattr(config, k, None))), None)


def limit_said(config: Any, requested: int | None, by: str, limit: int | None, new_tokens: int = 0) -> str:
    """Where :func:`source_limit`'s ``limit`` comes from, in words, for the errors that name it: the limit the
    user set (``by``: ``--max-source-length``, the preset's), else the model's context less the new tokens a
    decoder-only model generates after its prompt, else the tokenizer's ``model_max_length``."""
    if requested is not None and limit is not None and requested <= limit:
        return f"{by} {requested}"
    context = context_length(config)
    if context is None:
        return f"the tokenizer's model_max_length {limit}"
    less = f" less {new_tokens} new tokens" if new_tokens else ""
    return f"the model's context of {context} positions{less}"


def tokenizer_files(folder: Path, model_type: str | None) -> list[str]:
    """The files a checkpoint folder's tokenizer is read from: ``tokenizer.json`` (where the tokenizer class
    reads it) and its class's vocabulary files (``vocab.json``, ``merges.txt``, ``spiece.model``, ...). The
    class is ``tokenizer_config.json``'s ``tokenizer_class``, else the model type's. ``[]`` where that is
    unknown or reads no file (ByT5): nothing to check."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        settings = {}
    name = settings.get("tokenizer_class") if isinstance(settings, dict) else None
    name = name or TOKENIZER_MAPPING_NAMES.get(model_type or "") or "TokenizersBackend"
    try:
        cls = tokenizer_class_from_name(str(name))
    except (ImportError, AttributeError, ValueError):
        cls = None
    names = dict(getattr(cls, "vocab_files_names", None) or {}).values()
    files = [f for f in names if f not in ("tokenizer.json", "tokenizer_config.json")]
    if cls is not None and ("tokenizer.json" in names or issubclass(cls, TokenizersBackend)):
        files.insert(0, "tokenizer.json")
    return files


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """CPU runs: let glibc's malloc serve blocks up to ``mmap_threshold`` bytes (32 MiB, glibc's maximum)
    from its heap and keep up to ``trim_threshold`` bytes of freed memory there.

    By default glibc maps every block over 128 KiB-32 MiB afresh and unmaps it when freed, so each decode
    step's vocabulary-sized tensors ([N, V] logits, GEMM outputs) come back as new zero-filled pages:
    hundreds of thousands of page faults per batch (docs/EXPERIMENTS.md, "CPU float32: where a step goes").
    Process-wide; skipped where the user set ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` or
    there is no glibc. Returns whether it applied.
    """
    if not sys.platform.startswith("linux") or any(
        v in os.environ for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


@contextmanager
def fast_sinusoids(model_type: str | None) -> Iterator[None]:
    """While loading a Marian or Pegasus checkpoint, build the sinusoidal position tables with one numpy
    expression instead of transformers' Python loop over every entry (0.36 s per 512 x 512 table here, two
    per model; docs/EXPERIMENTS.md, "Start-up"). Same float64 operations element by element, so the same
    bits (``tests/test_tiny_models.py`` compares them); checked against transformers' own on a small table
    first, so a transformers whose formula differs keeps its own. Other model types are untouched."""
    from seqgen_cli.models.families import SINUSOID_CLASSES
    from seqgen_cli.models.families.bart import sinusoid_table

    name = SINUSOID_CLASSES.get(model_type or "")
    if name is None:
        yield
        return

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = getattr(module, name, None)
    original = getattr(cls, "create_weight", None)
    probe = cls(9, 7) if original is not None else None  # odd width: both halves' edge cases
    if probe is None or not torch.equal(sinusoid_table(probe), original(probe)):
        yield
        return
    cls.create_weight = sinusoid_table
    try:
        yield
    finally:
        cls.create_weight = original


def quiet_transformers() -> None:
    """Keep transformers' progress bars and advice out of seqgen's stderr (errors still show)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"transformers\.")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
