"""Model presets and loaders (preset, YAML/JSON file, Hugging Face config.json)."""

import json

import pytest

from berth.specs.errors import BerthError
from berth.specs.models import load_model, presets

PUBLISHED_PARAMS_B = {
    "llama2-7b": 6.74,
    "llama2-13b": 13.02,
    "llama2-70b": 68.98,
    "llama3-8b": 8.03,
    "llama3-70b": 70.55,
    "llama3.1-405b": 405.85,
    "mistral-7b": 7.24,
    "qwen2.5-7b": 7.62,
    "qwen2.5-72b": 72.71,
    "gpt3-175b": 174.6,
}


@pytest.mark.parametrize("name,billions", PUBLISHED_PARAMS_B.items())
def test_preset_parameter_counts(name, billions):
    assert presets()[name].num_params / 1e9 == pytest.approx(billions, rel=0.01)


LLAMA3_8B_HF = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_hf_llama_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_HF))
    m = load_model(str(path))
    assert (m.num_layers, m.kv_heads, m.mlp) == (32, 8, "swiglu")
    assert m.num_params == presets()["llama3-8b"].num_params
    assert m.name == tmp_path.name  # a config.json without _name_or_path is named by its folder, not "config"
    # where the Hugging Face cache keeps it: models--ORG--NAME/snapshots/<commit>/config.json, a link into blobs/
    repo = tmp_path / "models--meta-llama--Llama-3.1-8B"
    snapshot = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "0fe1").write_text(json.dumps(LLAMA3_8B_HF))
    (snapshot / "config.json").symlink_to("../../blobs/0fe1")
    assert load_model(str(snapshot / "config.json")).name == "Llama-3.1-8B"
    own = tmp_path / "my--llama" / "config.json"  # a folder of one's own is its name, dashes and all
    own.parent.mkdir()
    own.write_text(json.dumps(LLAMA3_8B_HF))
    assert load_model(str(own)).name == "my--llama"


@pytest.mark.parametrize(
    "cfg,expect",
    [
        (
            {
                "model_type": "mistral",
                "num_hidden_layers": 32,
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "vocab_size": 32000,
            },
            (32, 8, "swiglu"),
        ),
        (
            {
                "model_type": "qwen2",
                "num_hidden_layers": 28,
                "hidden_size": 3584,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "intermediate_size": 18944,
                "vocab_size": 152064,
            },
            (28, 4, "swiglu"),
        ),
        (
            {
                "model_type": "gpt2",
                "n_layer": 12,
                "n_embd": 768,
                "n_head": 12,
                "vocab_size": 50257,
                "activation_function": "gelu_new",
            },
            (12, 12, "gelu"),
        ),
        (
            {
                "model_type": "gpt_neox",
                "num_hidden_layers": 44,
                "hidden_size": 6144,
                "num_attention_heads": 64,
                "intermediate_size": 24576,
                "vocab_size": 50432,
                "hidden_act": "gelu",
            },
            (44, 64, "gelu"),
        ),
    ],
)
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


@pytest.mark.parametrize("model_type", [["llama"], {"family": "llama"}])
def test_a_model_type_that_is_no_text_is_refused_naming_it(model_type):
    """Found by mypy: a list or object as model_type was looked up in the family tables and raised
    TypeError (unhashable): a traceback from the CLI, a 500 from the API."""
    with pytest.raises(BerthError) as err:
        load_model({"model_type": model_type, "hidden_size": 64})
    assert err.value.field == "model.model_type" and "unsupported model type" in str(err.value)


def test_hf_config_missing_keys_are_named():
    with pytest.raises(BerthError) as err:
        load_model({"model_type": "llama", "hidden_size": 4096})
    assert "num_hidden_layers" in str(err.value)


_LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 32000,
}


@pytest.mark.parametrize(
    "extra,field",
    [
        # a dense family with experts would be planned as one dense MLP; an MoE family without top-k is incomplete
        ({"model_type": "llama", "num_local_experts": 8, "num_experts_per_tok": 2}, "model.num_local_experts"),
        ({"model_type": "qwen2_moe", "num_experts": 60}, "model.num_experts_per_tok"),
        # DeepSeek-V2/V3's multi-head latent attention and multi-token prediction are not modelled
        (
            {"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8, "kv_lora_rank": 512},
            "model.kv_lora_rank",
        ),
        (
            {
                "model_type": "deepseek_v3",
                "n_routed_experts": 256,
                "num_experts_per_tok": 8,
                "num_nextn_predict_layers": 1,
            },
            "model.num_nextn_predict_layers",
        ),
        (
            {"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 2},
            "model.decoder_sparse_step",
        ),
        (
            {
                "model_type": "mixtral",
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "sliding_window": 4096,
                "max_position_embeddings": 32768,
            },
            "model.sliding_window",
        ),
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "model.model_type"),
        ({"model_type": "t5", "is_encoder_decoder": True}, "model.model_type"),
        ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}, "model.architectures"),
        ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}, "model.sliding_window"),
        ({"model_type": "mistral", "head_dim": 160}, "model.head_dim"),
    ],
)
def test_unsupported_hf_architectures_are_refused(extra, field):
    with pytest.raises(BerthError) as err:
        load_model({**_LLAMA, **extra})
    assert err.value.field == field


def test_hf_mixtral_config_plans_as_the_preset():
    # mistralai/Mixtral-8x7B-v0.1 config.json (huggingface.co): 8 experts, top-2, experts 14336 wide
    cfg = {
        **_LLAMA,
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-05,
        "_name_or_path": "mixtral-8x7b",
    }
    m = load_model(cfg)
    assert m == presets()["mixtral-8x7b"]
    # Mistral AI's announcement: 46.7B total parameters, 12.9B used per token
    assert round(m.num_params / 1e9, 1) == 46.7 and round(m.active_params / 1e9, 1) == 12.9


def test_hf_qwen2_moe_and_deepseek_without_mla_load():
    # Qwen/Qwen1.5-MoE-A2.7B config.json: 60 experts top-4 of 1408, one shared expert of 5632; 14.3B, 2.7B active
    qwen = load_model(
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 24,
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "intermediate_size": 5632,
            "vocab_size": 151936,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
            "sliding_window": 32768,
            "tie_word_embeddings": False,
        }
    )
    assert (
        qwen.num_experts,
        qwen.experts_per_token,
        qwen.moe_ffn_hidden_size,
        qwen.num_shared_experts,
        qwen.shared_ffn,
    ) == (60, 4, 1408, 1, 5632)
    assert round(qwen.num_params / 1e9, 1) == 14.3 and round(qwen.active_params / 1e9, 1) == 2.7
    ds = load_model(
        {
            **_LLAMA,
            "model_type": "deepseek_v3",
            "n_routed_experts": 16,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 1024,
            "n_shared_experts": 1,
            "first_k_dense_replace": 2,
            "kv_lora_rank": None,
            "q_lora_rank": None,
            "moe_layer_freq": 1,
        }
    )
    assert (ds.num_experts, ds.first_k_dense, ds.num_moe_layers, ds.shared_ffn) == (16, 2, 30, 1024)


def test_moe_spec_rules_and_counts():
    m = presets()["deepseek-v3-style"]
    # DeepSeek-V3 (61 layers, 3 dense, 256 experts top-8 + 1 shared of 2048): 671B / 37B with MLA; with
    # GQA attention (128 kv heads, head_dim 56) the preset has about as many
    assert 660e9 < m.num_params < 680e9 and 36e9 < m.active_params < 40e9
    assert m.mean_ffn_hidden_size == 18432  # 8 x 2048 + 2048 = the dense layers' 18432
    dense = presets()["llama3-8b"] if "llama3-8b" in presets() else next(iter(presets().values()))
    assert dense.active_params == dense.num_params and dense.compute_view() is dense
    with pytest.raises(BerthError, match="experts_per_token"):
        load_model(
            {
                "num_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "ffn_hidden_size": 128,
                "vocab_size": 10,
                "num_experts": 4,
                "experts_per_token": 5,
            }
        )
    with pytest.raises(BerthError, match="num_experts"):
        load_model(
            {
                "num_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "ffn_hidden_size": 128,
                "vocab_size": 10,
                "experts_per_token": 2,
            }
        )


def test_hf_full_attention_window_and_dense_configs_load():
    # Mistral v0.2+ (no window), Qwen2 with the window switched off, one expert = dense
    for extra in (
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
        {"model_type": "llama", "sliding_window": 8192, "max_position_embeddings": 8192},
    ):
        assert load_model({**_LLAMA, **extra}).num_layers == 32


def test_heads_not_dividing_hidden_is_a_clear_error():
    with pytest.raises(BerthError) as err:
        load_model(
            {"num_layers": 2, "hidden_size": 100, "num_attention_heads": 3, "ffn_hidden_size": 400, "vocab_size": 10}
        )
    assert "num_attention_heads" in str(err.value)


def test_yaml_model_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(
        "num_layers: 4\nhidden_size: 256\nnum_attention_heads: 4\nffn_hidden_size: 1024\nvocab_size: 1000\n"
    )
    assert load_model(str(path)).name == "m"


def test_unknown_preset():
    with pytest.raises(BerthError) as err:
        load_model("llama9-1t")
    assert err.value.field == "model" and "llama3-70b" in str(err.value)


# mistralai/Mistral-7B-v0.1 config.json as published (huggingface.co/mistralai/Mistral-7B-v0.1, main):
# a 4,096-token sliding window, which is full causal attention for sequences up to 4,096 tokens.
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}


def test_a_sliding_window_that_covers_the_sequence_is_planned(tmp_path):
    """Mistral 7B v0.1 plans at sequence 4,096 (its window covers the sequence: exact full attention) and
    is refused at 8,192 naming the key, through the real CLI and the service's conversion alike."""
    import json
    import subprocess
    import sys

    from berth.planner.inputs import ClusterInput, TrainingInput, resolve

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MISTRAL_7B_V01))
    cli = [sys.executable, "-m", "berth.cli.main", "plan", str(path), "--global-batch", "64", "--top", "1"]
    ok = subprocess.run([*cli, "--seq-len", "4096", "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["plans"][0]["model"]["num_kv_heads"] == 8
    long = subprocess.run([*cli, "--seq-len", "8192"], capture_output=True, text=True, timeout=120)
    assert long.returncode == 2 and "model.sliding_window" in long.stderr and "8,192" in long.stderr, long.stderr
    spec, _, _ = resolve(MISTRAL_7B_V01, ClusterInput("dgx-h100"), TrainingInput(4096, 64), allow_files=False)
    assert spec.num_layers == 32
    with pytest.raises(BerthError) as err:
        resolve(MISTRAL_7B_V01, ClusterInput("dgx-h100"), TrainingInput(4097, 64), allow_files=False)
    assert err.value.field == "model.sliding_window"


def test_an_hf_config_without_model_type_is_told_what_it_misses(tmp_path):
    """Found trying a hand-written config.json: without model_type it was read as a berth spec and
    refused for a missing num_layers, a field such a file never has."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 28, "hidden_size": 3072}))
    with pytest.raises(BerthError) as err:
        load_model(str(path))
    assert err.value.field == "model.model_type" and "Hugging Face" in str(err.value) and "llama" in str(err.value)


def test_a_berth_spec_with_a_stray_hf_key_is_told_the_key():
    """A berth spec (it has num_layers) that also carries an HF key is not taken for an HF config: the key is named."""
    spec = {"name": "x", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128}
    with pytest.raises(BerthError) as err:
        load_model({**spec, "vocab_size": 100, "intermediate_size": 5})
    assert err.value.field == "model.intermediate_size"
