"""Model presets and loaders (preset, YAML/JSON file, Hugging Face config.json)."""

import json

import pytest

from planner.errors import BerthError
from planner.models import load_model, presets

PUBLISHED_PARAMS_B = {"llama2-7b": 6.74, "llama2-13b": 13.02, "llama2-70b": 68.98, "llama3-8b": 8.03,
                      "llama3-70b": 70.55, "llama3.1-405b": 405.85, "mistral-7b": 7.24,
                      "qwen2.5-7b": 7.62, "qwen2.5-72b": 72.71, "gpt3-175b": 174.6}


@pytest.mark.parametrize("name,billions", PUBLISHED_PARAMS_B.items())
def test_preset_parameter_counts(name, billions):
    assert presets()[name].num_params / 1e9 == pytest.approx(billions, rel=0.01)


LLAMA3_8B_HF = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                "vocab_size": 128256, "hidden_act": "silu", "tie_word_embeddings": False}


def test_hf_llama_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_HF))
    m = load_model(str(path))
    assert (m.num_layers, m.kv_heads, m.mlp) == (32, 8, "swiglu")
    assert m.num_params == presets()["llama3-8b"].num_params


@pytest.mark.parametrize("cfg,expect", [
    ({"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
      "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000}, (32, 8, "swiglu")),
    ({"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
      "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064}, (28, 4, "swiglu")),
    ({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
      "activation_function": "gelu_new"}, (12, 12, "gelu")),
    ({"model_type": "gpt_neox", "num_hidden_layers": 44, "hidden_size": 6144, "num_attention_heads": 64,
      "intermediate_size": 24576, "vocab_size": 50432, "hidden_act": "gelu"}, (44, 64, "gelu")),
])
def test_hf_families(cfg, expect):
    m = load_model(cfg)
    assert (m.num_layers, m.kv_heads, m.mlp) == expect


def test_gpt2_defaults_ffn_to_4h_and_ties_embeddings():
    m = load_model({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257})
    assert m.ffn_hidden_size == 3072 and m.tied_embeddings
    assert m.num_params / 1e6 == pytest.approx(124, rel=0.02)


def test_unknown_model_type_is_refused_with_the_supported_list():
    with pytest.raises(BerthError) as err:
        load_model({"model_type": "mamba", "d_model": 768, "n_layer": 24})
    assert err.value.field == "model.model_type" and "mamba" in str(err.value) and "llama" in str(err.value)


def test_hf_config_missing_keys_are_named():
    with pytest.raises(BerthError) as err:
        load_model({"model_type": "llama", "hidden_size": 4096})
    assert "num_hidden_layers" in str(err.value)


_LLAMA = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
          "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000}


@pytest.mark.parametrize("extra,field", [
    # Mixtral 8x7B's config.json: experts would be planned as one dense MLP
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
      "architectures": ["MixtralForCausalLM"]}, "model.num_local_experts"),
    ({"model_type": "qwen2_moe", "num_experts": 60}, "model.num_experts"),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "model.model_type"),
    ({"model_type": "t5", "is_encoder_decoder": True}, "model.model_type"),
    ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}, "model.architectures"),
    ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}, "model.sliding_window"),
    ({"model_type": "mistral", "head_dim": 160}, "model.head_dim"),
])
def test_unsupported_hf_architectures_are_refused(extra, field):
    with pytest.raises(BerthError) as err:
        load_model({**_LLAMA, **extra})
    assert err.value.field == field


def test_hf_full_attention_window_and_dense_configs_load():
    # Mistral v0.2+ (no window), Qwen2 with the window switched off, one expert = dense
    for extra in ({"model_type": "mistral", "sliding_window": None},
                  {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
                  {"model_type": "llama", "sliding_window": 8192, "max_position_embeddings": 8192}):
        assert load_model({**_LLAMA, **extra}).num_layers == 32


def test_heads_not_dividing_hidden_is_a_clear_error():
    with pytest.raises(BerthError) as err:
        load_model({"num_layers": 2, "hidden_size": 100, "num_attention_heads": 3,
                    "ffn_hidden_size": 400, "vocab_size": 10})
    assert "num_attention_heads" in str(err.value)


def test_yaml_model_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("num_layers: 4\nhidden_size: 256\nnum_attention_heads: 4\n"
                    "ffn_hidden_size: 1024\nvocab_size: 1000\n")
    assert load_model(str(path)).name == "m"


def test_unknown_preset():
    with pytest.raises(BerthError) as err:
        load_model("llama9-1t")
    assert err.value.field == "model" and "llama3-70b" in str(err.value)
