"""A causal LM's modules read straight from its directory (``config.json`` and safetensors), for the engines.

`hsd run` and `hsd serve` compute with the engines (:mod:`hsd_opt.engine`), which read a model's weights in place
and call none of its modules' forwards but the final norm's and the LM head's (trained exit heads share them).
Loading through ``AutoModelForCausalLM`` imports transformers' modeling code, and with it torch.distributed,
dynamo and sympy: seconds of start-up before the first token. :func:`load_direct` builds the modules the engines
read, under the names Hugging Face gives them, with the values ``from_pretrained`` gives them: the embeddings,
each layer's projections (with their biases) and norms, the final norm, the LM head (the embeddings themselves
where the config ties them) and the rotary module; and nothing else. The model's own forward raises
:class:`~hsd_opt.errors.HsdError`: whatever needs it (a Hugging Face baseline, training heads, building a bigram
table) loads the model through transformers.

It builds only what it reproduces exactly and returns None for anything else, so that the caller loads through
transformers instead: another model type than the engines support, an activation other than SiLU, a rotary
embedding other than the default one (or any ``rope_scaling``), a ``quantization_config``, a config without the
fields read here or whose default for the type differs from what is filled in here, weights not in safetensors,
tensor names other than exactly those the modules hold, or shapes other than the config gives them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hsd_opt.errors import HsdError

#: What :func:`load_direct` builds (the engines' model types, :data:`hsd_opt.engine.weights.SUPPORTED_MODEL_TYPES`).
DIRECT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

#: config.json fields read here or by the code that reads a loaded model's config, which transformers would
#: otherwise fill with its own defaults (so a config without one of them loads through transformers).
REQUIRED_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                   "vocab_size", "max_position_embeddings", "rms_norm_eps", "hidden_act", "bos_token_id",
                   "eos_token_id")
#: Fields whose transformers default for the model type is not what :class:`DirectConfig` fills in
#: (``num_key_value_heads``: the attention heads; ``head_dim``: hidden size over attention heads).
REQUIRED_BY_TYPE = {"mistral": ("num_key_value_heads",), "qwen2": ("num_key_value_heads",),
                    "qwen3": ("num_key_value_heads", "head_dim")}


class DirectConfig:
    """A model's ``config.json`` as attributes (every field as written), with ``num_key_value_heads`` and
    ``head_dim`` filled in as transformers fills them, ``_name_or_path`` (the directory) and ``_commit_hash``
    (None: not a hub snapshot)."""

    def __init__(self, fields: dict[str, Any], name_or_path: str):
        self.__dict__.update(fields)
        self.num_key_value_heads = fields.get("num_key_value_heads") or fields["num_attention_heads"]
        self.head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        self._name_or_path = name_or_path
        self._commit_hash = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class DirectRMSNorm(nn.Module):
    """An RMSNorm with transformers' Llama/Qwen arithmetic: ``weight * (x / sqrt(mean(x^2) + eps))``, the
    normalisation in float32, the product in the input's dtype. ``weight``: ``[hidden]``."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = float(eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DirectRotary(nn.Module):
    """The default rotary embedding, as transformers computes it: ``inv_freq[i] = 1 / theta^(2i / head_dim)`` in
    float32; called with ``(x, position_ids [b, m])`` it gives ``(cos, sin)``, each ``[b, m, head_dim]`` in
    ``x``'s dtype."""

    rope_type = "default"
    attention_scaling = 1.0

    def __init__(self, theta: float, head_dim: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _linear(weight: torch.Tensor | nn.Parameter, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight [out, in]`` (a Parameter is held as it is: tied) and ``bias [out]``.
    Built without ``nn.Linear.__init__``, which would initialise weights only to replace them (and, even on the
    meta device, import torch's compiler: a second of start-up)."""
    lin = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(lin)
    lin.in_features, lin.out_features = int(weight.shape[1]), int(weight.shape[0])
    lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if bias is None:
        lin.register_parameter("bias", None)
    else:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


class DirectAttention(nn.Module):
    """A layer's attention projections ``q_proj`` .. ``o_proj`` (and Qwen3's ``q_norm``/``k_norm``)."""


class DirectMLP(nn.Module):
    """A layer's SiLU MLP projections ``gate_proj``, ``up_proj``, ``down_proj``."""

    def __init__(self):
        super().__init__()
        self.act_fn = nn.SiLU()


class DirectLayer(nn.Module):
    """A decoder layer's ``self_attn``, ``mlp``, ``input_layernorm`` and ``post_attention_layernorm``."""


class DirectDecoder(nn.Module):
    """``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``: a causal LM's ``model``."""


class DirectCausalLM(nn.Module):
    """A decoder's modules as a Hugging Face causal LM holds them (``config``, ``generation_config``, ``model``,
    ``lm_head``), for the engines; no forward of its own (:class:`HsdError`)."""

    def __init__(self, config: DirectConfig, generation_config: Any, decoder: DirectDecoder, lm_head: nn.Linear):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.model, self.lm_head = decoder, lm_head

    def forward(self, *args, **kwargs):
        raise HsdError("this model was loaded for the decode engines only (hsd run, hsd serve) and has no forward "
                       "of its own; load it with hsd_opt.models.loading.load_model(..., engines_only=False)")

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype


def _rope_theta(fields: dict[str, Any]) -> float | None:
    """The default rotary embedding's theta (``rope_parameters``, or the older ``rope_theta``); None for any other
    rotary embedding, a config that does not say, or one with ``rope_scaling`` (transformers takes it over
    ``rope_parameters``)."""
    if fields.get("rope_scaling"):
        return None
    params = fields.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("rope_type", "default") != "default" or \
                set(params) - {"rope_type", "rope_theta"}:
            return None
        theta = params.get("rope_theta")
    else:
        theta = fields.get("rope_theta")
    return float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else None


def _weight_files(directory: Path) -> list[Path] | None:
    """The safetensors files of a model directory (one file, or the shards its index names); None without."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    files = [directory / s for s in shards]
    return files if files and all(f.is_file() for f in files) else None


#: A layer's projections: (module, attribute) as Hugging Face names them.
_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _expected_shapes(config: DirectConfig, tied: bool) -> dict[str, tuple[int, ...]]:
    """The tensors ``from_pretrained`` would fill for this config (biases and Qwen3's q/k norms included), by
    name, each with the shape its module has (transformers refuses a checkpoint that differs in either)."""
    mt = config.model_type
    attn_bias = mt == "qwen2" or (mt in ("llama", "qwen3") and bool(getattr(config, "attention_bias", False)))
    mlp_bias = mt == "llama" and bool(getattr(config, "mlp_bias", False))
    d, hd, inter, vocab = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q), "gate_proj": (inter, d),
              "up_proj": (inter, d), "down_proj": (d, inter)}
    want = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not tied:
        want["lm_head.weight"] = (vocab, d)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        want.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        for module, proj in _PROJECTIONS:
            want[f"{p}{module}.{proj}.weight"] = shapes[proj]
            if (attn_bias and module == "self_attn" and (proj != "o_proj" or mt != "qwen2")) or \
                    (mlp_bias and module == "mlp"):
                want[f"{p}{module}.{proj}.bias"] = shapes[proj][:1]
        if mt == "qwen3":
            want.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return want


def load_direct(directory: str | Path, dtype: torch.dtype) -> DirectCausalLM | None:
    """The model in ``directory`` (a transformers model directory with safetensors weights) as a
    :class:`DirectCausalLM` on the CPU, its weights in ``dtype``; None where this module does not reproduce
    ``AutoModelForCausalLM.from_pretrained`` exactly (the module's docstring lists the cases)."""
    from safetensors import safe_open

    directory = Path(directory)
    try:
        fields = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict) or fields.get("model_type") not in DIRECT_MODEL_TYPES or \
            any(f not in fields for f in REQUIRED_FIELDS + REQUIRED_BY_TYPE.get(fields["model_type"], ())) or \
            fields.get("hidden_act") != "silu" or fields.get("quantization_config") is not None:
        return None
    theta = _rope_theta(fields)
    files = _weight_files(directory)
    if theta is None or files is None:
        return None
    tied = bool(fields.get("tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for k in st.keys():
                    tensors[k] = st.get_tensor(k)
    except Exception:       # an unreadable file (safetensors' own error type): transformers names what is wrong
        return None
    config = DirectConfig(fields, str(directory))
    if {k: tuple(v.shape) for k, v in tensors.items()} != _expected_shapes(config, tied):
        return None
    t = {k: v.to(dtype) for k, v in tensors.items()}
    eps = float(fields["rms_norm_eps"])
    layers = nn.ModuleList()
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = DirectLayer()
        layer.self_attn, layer.mlp = DirectAttention(), DirectMLP()
        for module, proj in _PROJECTIONS:
            name = f"{p}{module}.{proj}"
            setattr(getattr(layer, module), proj, _linear(t[name + ".weight"], t.get(name + ".bias")))
        if config.model_type == "qwen3":
            layer.self_attn.q_norm = DirectRMSNorm(t[p + "self_attn.q_norm.weight"], eps)
            layer.self_attn.k_norm = DirectRMSNorm(t[p + "self_attn.k_norm.weight"], eps)
        layer.input_layernorm = DirectRMSNorm(t[p + "input_layernorm.weight"], eps)
        layer.post_attention_layernorm = DirectRMSNorm(t[p + "post_attention_layernorm.weight"], eps)
        layers.append(layer)
    embed = t["model.embed_tokens.weight"]
    decoder = DirectDecoder()
    decoder.embed_tokens = nn.Embedding(embed.shape[0], embed.shape[1], _weight=embed, _freeze=True)
    decoder.layers = layers
    decoder.norm = DirectRMSNorm(t["model.norm.weight"], eps)
    decoder.rotary_emb = DirectRotary(theta, config.head_dim)
    lm_head = _linear(decoder.embed_tokens.weight if tied else t["lm_head.weight"], None)
    return DirectCausalLM(config, _generation_config(directory), decoder, lm_head)


def _generation_config(directory: Path) -> Any:
    """``generation_config.json``'s fields as attributes (None without the file: the config's ids then serve)."""
    from types import SimpleNamespace

    try:
        fields = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    return SimpleNamespace(**fields) if isinstance(fields, dict) else None
