"""Model presets and loaders: a preset name, a YAML/JSON ModelSpec file, or a Hugging Face
config.json (a file or an already-parsed dict)."""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from berth.specs.errors import BerthError, from_validation_error
from berth.specs.tree import MAX_NAME_LEN, ModelSpec, RopeScaling

PRESETS_FILE = Path(__file__).parent / "model_presets.json"


def presets() -> dict[str, ModelSpec]:
    return dict(_presets())


@cache
def _presets() -> dict[str, ModelSpec]:
    raw = json.loads(PRESETS_FILE.read_text())
    return {name: ModelSpec(name=name, **fields) for name, fields in raw.items()}


def load_model(ref: str | dict[str, Any], allow_files: bool = True, seq_len: int | None = None) -> ModelSpec:
    """A ModelSpec from a preset name, a path to a YAML/JSON file, or a dict (a ModelSpec or an
    HF config). The service passes allow_files=False: a request never reads the server's disk.
    `seq_len`: the sequence it will be planned at (an HF config's sliding window, `_check_window`)."""
    if isinstance(ref, dict):
        return model_from_dict(ref, source="model", seq_len=seq_len)
    known = presets()
    if ref in known:
        return known[ref]
    if not allow_files:
        raise BerthError(
            "model",
            ref,
            f"unknown preset; presets: {', '.join(sorted(known))}; or give a model spec or an HF config object",
        )
    path = Path(ref)
    if not path.is_file():
        raise BerthError("model", ref, f"not a preset nor a file; presets: {', '.join(sorted(known))}")
    try:
        text = path.read_text()
    except OSError as err:
        raise BerthError("model", ref, f"cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise BerthError(
            "model", ref, "not a text file (expected a YAML/JSON model spec or an HF config.json)"
        ) from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise BerthError("model", ref, f"cannot parse YAML: {str(err).splitlines()[0]}") from None
        else:
            data = json.loads(text)
    except json.JSONDecodeError as err:
        raise BerthError("model", ref, f"not JSON: {err.msg} at line {err.lineno}") from None
    if not isinstance(data, dict):
        raise BerthError("model", ref, "file must hold one object")
    name, up = path.stem, Path(os.path.abspath(path)).parent  # not resolved: the HF cache links into its blobs/
    if name == "config":  # an HF download: its folder's name (a cache snapshot's: models--ORG--NAME/snapshots/<hash>)
        up = up.parent.parent if up.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", up.name) else up
        name = re.sub(r"^models--.+?--", "", up.name) or name
    stem = re.sub(r"[^A-Za-z0-9_.+-]", "-", name)[:MAX_NAME_LEN] or "model"  # a file's name: made safe
    if "model_type" in data:
        if not data.get("_name_or_path") and not data.get("name"):
            data["_name_or_path"] = stem
    else:
        data.setdefault("name", stem)
    return model_from_dict(data, source="model", seq_len=seq_len)


# Keys only a Hugging Face config carries: such a file without model_type is told what it misses.
_HF_ONLY_KEYS = (
    "architectures",
    "transformers_version",
    "num_hidden_layers",
    "n_layer",
    "n_embd",
    "n_head",
    "intermediate_size",
    "num_key_value_heads",
)


def model_from_dict(data: dict[str, Any], source: str = "model", seq_len: int | None = None) -> ModelSpec:
    if "model_type" in data:
        return from_hf_config(data, source, seq_len)
    hf_keys = [key for key in _HF_ONLY_KEYS if key in data]
    if hf_keys and "num_layers" not in data:  # a berth spec with a stray key is told the key (extra="forbid")
        raise BerthError(
            f"{source}.model_type",
            None,
            f"missing: this looks like a Hugging Face config ({', '.join(hf_keys)}), which names its family in "
            f"model_type (one of {', '.join(sorted(_HF_FAMILIES))}); add it, or write a berth model spec",
        )
    try:
        return ModelSpec.model_validate(data, strict=True)  # no bool or text as a number
    except ValidationError as err:
        raise from_validation_error(err, source) from None


# Hugging Face config keys by model family: (layers, hidden, heads, kv heads, ffn, vocab).
_LLAMA_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
_HF_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"keys": _LLAMA_KEYS, "mlp": "swiglu", "norm": "rmsnorm", "tied": False},
    "mistral": {"keys": _LLAMA_KEYS, "mlp": "swiglu", "norm": "rmsnorm", "tied": False},
    "qwen2": {"keys": _LLAMA_KEYS, "mlp": "swiglu", "norm": "rmsnorm", "tied": False},
    # mixture of experts (_moe_fields): Mixtral, Qwen2-MoE, DeepSeek-V2/V3 without MLA
    "mixtral": {"keys": _LLAMA_KEYS, "mlp": "swiglu", "norm": "rmsnorm", "tied": False},
    "qwen2_moe": {"keys": _LLAMA_KEYS, "mlp": "swiglu", "norm": "rmsnorm", "tied": False},
    "deepseek_v2": {"keys": _LLAMA_KEYS, "mlp": "swiglu", "norm": "rmsnorm", "tied": False},
    "deepseek_v3": {"keys": _LLAMA_KEYS, "mlp": "swiglu", "norm": "rmsnorm", "tied": False},
    "gpt2": {
        "keys": ("n_layer", "n_embd", "n_head", None, "n_inner", "vocab_size"),
        "mlp": "gelu",
        "norm": "layernorm",
        "tied": True,
    },
    "gpt_neox": {
        "keys": ("num_hidden_layers", "hidden_size", "num_attention_heads", None, "intermediate_size", "vocab_size"),
        "mlp": "gelu",
        "norm": "layernorm",
        "tied": False,
    },
}
_OPTIONAL = {"num_key_value_heads", "n_inner"}


# Mixture-of-experts keys by model type: (experts, top-k, expert ffn, shared experts, shared ffn, dense
# leading layers). None: the family has no such key (Mixtral's experts are intermediate_size wide;
# Qwen2-MoE has one shared expert of shared_expert_intermediate_size).
# (experts, experts per token, then the optional keys: expert ffn, shared experts, shared ffn, first dense)
_MOE_FIELDS: dict[str, tuple[str, str, str | None, str | None, str | None, str | None]] = {
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size", None, None, None),
    "qwen2_moe": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        None,
        "shared_expert_intermediate_size",
        None,
    ),
    "deepseek_v2": (
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",
        None,
        "first_k_dense_replace",
    ),
    "deepseek_v3": (
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",
        None,
        "first_k_dense_replace",
    ),
}
# Keys of a config that say the model is a mixture of experts: refused outside the families above
# (a dense family with one of these would be planned as a dense model, and be wrong).
_MOE_KEYS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
# Architectural keys berth does not model, refused when set: multi-head latent attention (DeepSeek-V2/V3),
# multi-token prediction, MoE layers at a stride, dense layers listed by index.
_UNMODELLED = {
    "kv_lora_rank": "multi-head latent attention (MLA) is not modelled; berth prices standard (GQA) attention "
    "(the deepseek-v3-style preset uses GQA)",
    "q_lora_rank": "multi-head latent attention (MLA) is not modelled; berth prices standard (GQA) attention",
    "num_nextn_predict_layers": "multi-token prediction layers are not modelled",
    "mlp_only_layers": "dense layers at listed positions are not modelled (only the first k: first_k_dense)",
}
_ENCODER_TYPES = (
    "bert",
    "roberta",
    "xlm-roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta",
    "deberta-v2",
    "t5",
    "mt5",
    "umt5",
    "bart",
    "mbart",
    "pegasus",
    "marian",
    "whisper",
    "longt5",
    "switch_transformers",
)
_DECODER_ONLY_HEADS = ("ForCausalLM", "LMHeadModel", "Model")


def _check_window(cfg: dict[str, Any], source: str, seq_len: int | None) -> None:
    """Sliding-window attention (Mistral 7B v0.1: 4,096 tokens) is not modelled: berth prices full causal
    attention, which is the same computation while the window covers the whole sequence. So a window at
    least as long as the sequence planned (`seq_len`; not given: the longest the config allows,
    max_position_embeddings) is accepted, and a shorter one refused naming the key."""
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or not cfg.get("use_sliding_window", True):
        return
    longest = seq_len if seq_len is not None else cfg.get("max_position_embeddings")
    if isinstance(longest, int) and window < longest:
        what = f"the sequence of {longest:,} tokens" if seq_len is not None else f"max_position_embeddings {longest:,}"
        raise BerthError(
            f"{source}.sliding_window",
            window,
            f"a window shorter than {what}: sliding-window attention is not modelled (berth prices full causal "
            f"attention, exact while the window covers the sequence); plan sequences up to {window:,} tokens, or "
            "set it to null to plan full attention",
        )


def _refuse_unsupported(cfg: dict[str, Any], source: str, seq_len: int | None = None) -> None:
    """Refuse a config whose architecture berth does not model (a BerthError naming the key)."""
    supported = f"supported: dense decoder-only {', '.join(sorted(_HF_FAMILIES))}"
    model_type = cfg.get("model_type")
    supported += f"; mixture of experts {', '.join(sorted(_MOE_FIELDS))}"
    if model_type is not None and not isinstance(model_type, str):  # a list or object: no family to look up
        raise BerthError(f"{source}.model_type", model_type, f"unsupported model type; {supported}")
    for key in _MOE_KEYS:
        if model_type not in _MOE_FIELDS and cfg.get(key) not in (None, 0, 1, False):
            raise BerthError(
                f"{source}.{key}",
                cfg[key],
                f"a mixture-of-experts model ({model_type}) of a family berth does not map; {supported}",
            )
    for key, why in _UNMODELLED.items():
        if model_type in _MOE_FIELDS and cfg.get(key) not in (None, 0, False, [], ()):
            raise BerthError(f"{source}.{key}", cfg[key], why)
    for key in ("decoder_sparse_step", "moe_layer_freq"):
        if model_type in _MOE_FIELDS and cfg.get(key) not in (None, 1):
            raise BerthError(
                f"{source}.{key}",
                cfg[key],
                "MoE layers at a stride other than 1 are not modelled "
                "(every layer after the first first_k_dense is MoE)",
            )
    if model_type in _ENCODER_TYPES or cfg.get("is_encoder_decoder"):
        key = "model_type" if model_type in _ENCODER_TYPES else "is_encoder_decoder"
        raise BerthError(f"{source}.{key}", cfg.get(key), f"an encoder or encoder-decoder model; {supported}")
    architectures = cfg.get("architectures")
    if architectures is not None and not isinstance(architectures, list):
        raise BerthError(f"{source}.architectures", architectures, "expected a list of class names")
    for arch in architectures or ():
        if isinstance(arch, str) and not arch.endswith(_DECODER_ONLY_HEADS):
            raise BerthError(f"{source}.architectures", arch, f"not a causal language model; {supported}")
    if model_type not in _HF_FAMILIES:
        raise BerthError(
            f"{source}.model_type",
            model_type,
            f"unsupported model type; {supported} (or write a berth model spec: docs)",
        )
    _check_window(cfg, source, seq_len)
    heads, hidden, head_dim = (
        cfg.get("num_attention_heads", cfg.get("n_head")),
        cfg.get("hidden_size", cfg.get("n_embd")),
        cfg.get("head_dim"),
    )
    if (
        isinstance(head_dim, int)
        and isinstance(heads, int)
        and isinstance(hidden, int)
        and heads
        and head_dim * heads != hidden
    ):
        raise BerthError(
            f"{source}.head_dim",
            head_dim,
            f"differs from hidden_size / num_attention_heads = "
            f"{hidden}/{heads}; berth's layers assume head_dim x heads = hidden_size",
        )


def _moe_fields(cfg: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """ModelSpec's mixture-of-experts fields from a config of a family in _MOE_FIELDS ({} otherwise)."""
    keys = _MOE_FIELDS.get(model_type)
    if keys is None:
        return {}
    names = (
        "num_experts",
        "experts_per_token",
        "moe_ffn_hidden_size",
        "num_shared_experts",
        "shared_expert_ffn_hidden_size",
        "first_k_dense",
    )
    out: dict[str, Any] = {}
    for name, key in zip(names, keys, strict=True):
        if key is None or cfg.get(key) is None:
            continue
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BerthError(f"{source}.{key}", value, "must be a non-negative integer")
        out[name] = value
    for name, key in (("num_experts", keys[0]), ("experts_per_token", keys[1])):
        if not out.get(name):
            raise BerthError(f"{source}.{key}", cfg.get(key), f"a {model_type} config needs a positive {key}")
    if out.get("shared_expert_ffn_hidden_size"):
        out["num_shared_experts"] = 1  # Qwen2-MoE: one shared expert (its sigmoid gate, h x 1, left out)
    if not out.get("num_shared_experts"):
        out.pop("shared_expert_ffn_hidden_size", None)
    if out.get("moe_ffn_hidden_size") is None:
        out["moe_ffn_hidden_size"] = cfg.get("intermediate_size")
    return out


def _launch_details(cfg: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The model details launch files carry (rope base and scaling, norm epsilon, qkv bias) from a config:
    rope_theta (GPT-NeoX: rotary_emb_base), rms_norm_eps / layer_norm_eps / layer_norm_epsilon, rope_scaling
    of rope_type 'llama3' (other kinds are not carried: null), attention_bias (Qwen2 always has qkv biases)."""
    out: dict[str, Any] = {}
    for name, keys in (
        ("rope_theta", ("rope_theta", "rotary_emb_base")),
        ("norm_eps", ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")),
    ):
        key = next((k for k in keys if cfg.get(k) is not None), None)
        if key is None:
            continue
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise BerthError(f"{source}.{key}", value, "must be a positive number")
        out[name] = float(value)
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "llama3":
        fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        try:
            out["rope_scaling"] = RopeScaling.model_validate({k: scaling[k] for k in fields if k in scaling})
        except ValidationError as err:
            raise from_validation_error(err, f"{source}.rope_scaling") from None
    bias = cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))
    if not isinstance(bias, bool):
        raise BerthError(f"{source}.attention_bias", bias, "must be true or false")
    out["qkv_bias"] = bias
    return out


def from_hf_config(cfg: dict[str, Any], source: str = "model", seq_len: int | None = None) -> ModelSpec:
    """Map a Hugging Face config.json of a decoder-only model to a ModelSpec: dense families and the mixture-of-experts
    ones of _MOE_FIELDS (Mixtral, Qwen2-MoE, DeepSeek-V2/V3 without MLA). Other mixtures of experts, MLA, encoders,
    encoder-decoders, a sliding window shorter than the sequence (`_check_window`), a head_dim other than
    hidden/heads and unknown model types are refused naming the key (they would be planned wrongly). Attention/MLP
    biases are ignored (under 0.1% of the parameters and FLOPs)."""
    _refuse_unsupported(cfg, source, seq_len)
    model_type: str = cfg["model_type"]  # a family of _HF_FAMILIES: _refuse_unsupported refused anything else
    family = _HF_FAMILIES[model_type]
    keys = family["keys"]
    missing = [k for k in keys if k and k not in cfg and k not in _OPTIONAL]
    if missing:
        supported = ", ".join(sorted(_HF_FAMILIES))
        raise BerthError(
            f"{source}.model_type",
            model_type,
            f"config lacks {', '.join(missing)} (supported model types: {supported})",
        )
    for key in (k for k in keys if k and cfg.get(k) is not None):  # no bool, float or text as a count
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int):
            raise BerthError(f"{source}.{key}", cfg[key], "must be an integer")
    layers, hidden, heads, kv, ffn, vocab = (cfg.get(k) if k else None for k in keys)
    if ffn is None:
        ffn = 4 * hidden if isinstance(hidden, int) else None
    act_key = "hidden_act" if "hidden_act" in cfg else "activation_function"
    act = cfg.get(act_key, "")
    if not isinstance(act, str):
        raise BerthError(f"{source}.{act_key}", act, "must be a string (an activation name)")
    act = act.lower()
    mlp = family["mlp"] if not act else ("swiglu" if act in ("silu", "swish", "swiglu") else "gelu")
    drop_key = "attention_dropout" if "attention_dropout" in cfg else "attn_pdrop"
    dropout = cfg.get(drop_key) or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout <= 1.0:
        raise BerthError(f"{source}.{drop_key}", dropout, "must be a number in [0, 1]")
    tied = cfg.get("tie_word_embeddings", family["tied"])
    if not isinstance(tied, bool):
        raise BerthError(f"{source}.tie_word_embeddings", tied, "must be true or false")
    name_key = next((k for k in ("_name_or_path", "name") if cfg.get(k)), None)
    moe = _moe_fields(cfg, model_type, source)
    details = _launch_details(cfg, model_type, source)
    fields = {
        **moe,
        "name": cfg[name_key] if name_key else (model_type if isinstance(model_type, str) else "hf-model"),
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": kv,
        "ffn_hidden_size": ffn,
        "vocab_size": vocab,
        "mlp": mlp,
        "norm": family["norm"],
        "tied_embeddings": tied,
        "dropout": dropout > 0.0,
        **details,
    }
    try:
        return ModelSpec.model_validate(fields, strict=True)
    except ValidationError as err:
        # name the key the user wrote, not ours
        hf_key = dict(
            zip(
                ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size"),
                keys,
                strict=True,
            )
        ) | {"name": name_key or "model_type"}
        hf_key |= {
            k: v
            for k, v in zip(
                (
                    "num_experts",
                    "experts_per_token",
                    "moe_ffn_hidden_size",
                    "num_shared_experts",
                    "shared_expert_ffn_hidden_size",
                    "first_k_dense",
                ),
                _MOE_FIELDS.get(model_type, ()),
                strict=False,
            )
            if v
        }
        loc = err.errors()[0].get("loc", ())
        field = hf_key.get(str(loc[0])) if loc else None
        if field:
            first = err.errors()[0]
            raise BerthError(f"{source}.{field}", first.get("input"), first.get("msg", "invalid")) from None
        raise from_validation_error(err, source) from None
