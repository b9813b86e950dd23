"""A model built from its configuration alone, with random weights: what costs are measured on where the weights
are not at hand (``hsd profile --costs-only``, ``benchmarks/gpu_scale.py``).

A decode step's seconds depend on the model's shapes, its dtype, its weights' form and the device, not on its
weights' values, so a model of the same configuration with random weights costs what the real one does where the
form is the same, and nothing but a ``config.json`` (and, where there is one, a tokenizer) is read. Not on the CPU
kernels for a model de-quantized from GGUF, whose weights are read in their exact int4/int8 forms: a costs-only run
times weights on this machine themselves (:func:`load_for_costs`). Configurations: a shipped one
(``hsd_opt/data/configs/<name>.json``: LayerSkip-Llama2-7B's, TinyLlama-1.1B's, and those of the models ``hsd models
fetch`` serves, under their aliases, for a machine that has not fetched them), ``tiny`` (a 4-layer model for a dry
run on a CPU), a ``config.json`` file, or any model ``hsd`` loads (an alias, a hub id, a directory, a GGUF file: its
configuration and tokenizer only).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsd_opt.errors import HsdError

if TYPE_CHECKING:
    import torch

    from hsd_opt.models.loading import LoadedModel

#: Where the shipped configurations are.
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
#: ``LoadedModel.source`` of a model with random weights (a pool around it builds its drafters the same way).
RANDOM_SOURCE = "random"
#: A 4-layer model for a dry run on a CPU (seconds).
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
#: The factor on the LM head's random weights: peaked logits, as a trained model's are (a greedy read through the
#: head's int8 screen then takes the path it takes on a trained model, and greedy tokens do not hang on near-ties).
PEAK = 8.0


def shipped_configs() -> list[str]:
    """The names of the shipped configurations, and ``tiny``."""
    return sorted(p.stem for p in CONFIGS.glob("*.json")) + ["tiny"]


def config_of(name: str, flag: str = "--config") -> dict[str, Any]:
    """The configuration named ``name``: a shipped one, ``tiny``, or a ``config.json`` path; Hugging Face's keys
    only (``_source`` and other keys starting with ``_`` dropped). :class:`HsdError` naming ``flag`` otherwise."""
    if name == "tiny":
        return dict(TINY)
    path = CONFIGS / f"{name}.json" if (CONFIGS / f"{name}.json").is_file() else Path(name)
    if not path.is_file():
        raise HsdError(f"{flag}: no configuration {name!r} (shipped: {', '.join(shipped_configs())}; or a "
                       f"config.json path)")
    return _read_config(path, flag)


def _read_config(path: Path, flag: str) -> dict[str, Any]:
    """The JSON object of the ``config.json`` at ``path`` (keys starting with ``_`` dropped); :class:`HsdError`
    naming ``flag`` and the file for one that is no such object."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HsdError(f"{flag} {path}: not a readable config.json ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("num_hidden_layers"), int):
        raise HsdError(f"{flag} {path}: not a model configuration (no num_hidden_layers)")
    for key in ("num_hidden_layers", "vocab_size", "hidden_size"):
        v = raw.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise HsdError(f"{flag} {path}: {key} must be an integer >= 1, got {v!r}")
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def random_model(config: dict[str, Any], device: "str | torch.device", dtype: "torch.dtype", peak: float = PEAK,
                 seed: int = 0, flag: str = "--model"):
    """A causal LM of ``config`` (its ``model_type``, Llama where none is named) with random weights, made
    directly on ``device`` in ``dtype``, the LM head scaled by ``peak`` (eval mode); :class:`HsdError` naming
    ``flag`` for a configuration ``transformers`` builds no causal LM of."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.get("model_type", "llama"), **kw))
    except Exception as e:  # noqa: BLE001 (transformers' checks raise assertions and validation errors of its own)
        why = " ".join(str(e).split()) or type(e).__name__      # one line (some span several)
        raise HsdError(f"{flag}: cannot build a causal LM of this configuration "
                       f"({why if len(why) <= 160 else why[:160] + '...'})") from None
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    return model.eval()


def _config_and_tokenizer(name: str, flag: str) -> tuple[dict[str, Any], Any]:
    """The configuration ``name`` names for a model with random weights, and its tokenizer (None where there is
    none): a ``config.json`` file (the tokenizer of its directory, if any), a shipped configuration or ``tiny``
    (none), else any model :func:`~hsd_opt.models.loading.model_source` finds (its ``config.json`` and tokenizer
    only)."""
    from hsd_opt.models.loading import model_source

    path = Path(name)
    if path.is_file() and path.suffix == ".json":
        return _read_config(path, flag), _tokenizer(path.parent)
    if name == "tiny" or (CONFIGS / f"{name}.json").is_file():
        return config_of(name, flag), None
    try:
        source, load_from, _ = model_source(name)
    except HsdError as e:
        raise HsdError(f"{str(e).replace('--model', flag, 1)}; or a shipped configuration "
                       f"({', '.join(shipped_configs())}) or a config.json path") from None
    if source != "hub":
        return _read_config(Path(load_from) / "config.json", flag), _tokenizer(load_from)
    return _hub_config(load_from, flag), _tokenizer(load_from)


def _hub_config(model_id: str, flag: str) -> dict[str, Any]:
    """The configuration of hub model ``model_id`` (its ``config.json`` alone, from the hub or its cache)."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError) as e:
        raise HsdError(f"{flag} {model_id}: cannot read its config.json from the Hugging Face hub or its local "
                       f"cache ({str(e).splitlines()[0]})") from None
    return {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}


def _tokenizer(where: str | Path):
    """The tokenizer saved at ``where`` (a directory or a hub id), or None where there is none: where loading it
    fails, or gives a tokenizer of at most one token (transformers makes one of the configuration's end token alone
    from a folder that holds a ``config.json`` and no tokenizer)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(where))
    except (OSError, ValueError, TypeError):
        return None
    return tok if len(tok) > 1 else None


def weights_here(name: str) -> bool:
    """Whether ``name`` names weights on this machine (the embedded model or a fetched one, a ``.gguf`` file, a
    model directory), not a configuration alone (a ``config.json``, ``tiny``, a shipped configuration: the
    registry's models have theirs, ``qwen2.5-coder-1.5b.json``, timed on random weights where the model is not
    fetched, under the same name as where it is) or a hub id.
    A costs-only run times such weights themselves: their form decides the speed of the CPU kernels (a float32
    model de-quantized from GGUF's Q4_1 is read in its exact int4 form, an eighth of the bytes; random weights of
    the same shape are read as float32)."""
    from hsd_opt.models.loading import model_source

    path = Path(name)
    if (path.is_file() and path.suffix == ".json") or name == "tiny":
        return False
    try:
        return model_source(name)[0] != "hub"
    except HsdError:
        return False          # not here: a shipped configuration of that name, else load_random says what is wrong


def load_for_costs(name: str, device: str = "auto", dtype: str = "auto", flag: str = "--model") -> "LoadedModel":
    """The model a costs-only run times: its own weights where they are on this machine (:func:`weights_here`),
    else random weights of its configuration (:func:`load_random`)."""
    if weights_here(name):
        from hsd_opt.models.loading import load_model

        return load_model(name, device=device, dtype=dtype)
    return load_random(name, device=device, dtype=dtype, flag=flag)


def load_random(name: str, device: str = "auto", dtype: str = "auto", flag: str = "--model") -> "LoadedModel":
    """A :class:`~hsd_opt.models.loading.LoadedModel` of the configuration ``name`` names (see the module doc)
    with random weights, in ``dtype`` on ``device`` (as :func:`~hsd_opt.models.loading.load_model` resolves them),
    with its tokenizer or None. Its ``source`` is :data:`RANDOM_SOURCE`, its ``revision`` ``config:`` and the
    configuration's SHA-256 (16 hex digits); quantized copies of it are never stored on disk. Raises
    :class:`HsdError` naming ``flag``."""
    import torch

    from hsd_opt.models.loading import LoadedModel, resolve_device, resolve_dtype, resolve_model_name

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    config, tokenizer = _config_and_tokenizer(name, flag)
    model = random_model(config, dev, dt, flag=flag)
    torch.set_grad_enabled(False)
    if dev.type == "cpu":
        from hsd_opt.models.memory import resident_weights

        resident_weights(model)
    model.hsd_weights_key = None              # random weights: no copy of them is worth keeping
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(name)
    model_id = str(path.parent) if path.is_file() and path.name == "config.json" else resolve_model_name(name)
    return LoadedModel(model, tokenizer, model_id, f"config:{digest}", RANDOM_SOURCE, str(dev),
                       str(dt).replace("torch.", ""))
