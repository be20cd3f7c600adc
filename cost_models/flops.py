"""FLOPs of a decoder layer, the LM head and a training step.

Counting convention (Narayanan et al. 2021, Eq. 3; Korthikanti et al. 2022, Eq. 7): only matrix
multiplies count, 2 FLOPs per multiply-add; the attention score and context products count the
full s x s matrix (no causal halving); backward costs twice the forward. Model FLOPs (for MFU)
count forward + backward once; hardware FLOPs add the forward recomputed by activation
checkpointing (Korthikanti 2022, Eq. 8).

Departures: K and V projections are sized by the key/value heads (GQA), and the MLP has 2
(GELU) or 3 (SwiGLU) weight matrices of h x ffn. For GPT (g = 1, ffn = 4h, 2 matrices) the layer
forward is 24bsh^2 + 4bs^2h, exactly Megatron's count.

Arguments: `b` is the micro-batch size (scalar or array), `s` the sequence length.
"""

from __future__ import annotations

import numpy as np

from berth.cost_models.arrays import ArrayOrFloat
from berth.specs.candidates import RECOMPUTE_FULL, RECOMPUTE_SELECTIVE
from berth.specs.tree import ModelSpec, TrainingSpec

BACKWARD_TO_FORWARD = 2.0  # dgrad + wgrad GEMMs, each the size of the forward GEMM


def attention_projection_flops(model: ModelSpec, s: int, b) -> ArrayOrFloat:
    """Q, K, V and output projections, forward: 2bsh(h + 2 g h) + 2bsh^2 (GQA: g = kv/heads)."""
    h = model.hidden_size
    return 2.0 * b * s * h * (h + 2 * model.kv_heads * model.head_dim) + 2.0 * b * s * h * h


def attention_core_flops(model: ModelSpec, s: int, b) -> ArrayOrFloat:
    """QK^T and attention-over-V, forward: 4bs^2h (Narayanan 2021 Eq. 3, full s^2)."""
    return 4.0 * b * s * s * model.hidden_size


def mlp_flops(model: ModelSpec, s: int, b) -> ArrayOrFloat:
    """MLP forward: 2bsh*ffn per weight matrix (2 for GELU, 3 for SwiGLU)."""
    return 2.0 * b * s * model.hidden_size * model.ffn_hidden_size * model.mlp_matrices


def layer_forward_flops(model: ModelSpec, s: int, b) -> ArrayOrFloat:
    return attention_projection_flops(model, s, b) + attention_core_flops(model, s, b) + mlp_flops(model, s, b)


def lm_head_flops(model: ModelSpec, s: int, b) -> ArrayOrFloat:
    """Output projection to the vocabulary, forward: 2bshV (Narayanan 2021 Eq. 3, last term)."""
    return 2.0 * b * s * model.hidden_size * model.vocab_size


def model_flops_per_step(model: ModelSpec, training: TrainingSpec) -> float:
    """Forward + backward FLOPs of one step over the global batch, without recomputation.

    For GPT this is Korthikanti 2022 Eq. 7: 72BLsh^2(1 + s/6h + V/12hL).
    """
    b, s = training.global_batch_size, training.seq_len
    per_pass = model.num_layers * layer_forward_flops(model.compute_view(), s, b) + lm_head_flops(model, s, b)
    return float((1.0 + BACKWARD_TO_FORWARD) * (per_pass + router_flops(model, s, b)))


def router_flops(model: ModelSpec, s: int, b) -> ArrayOrFloat:
    """MoE: the router's h x E GEMM of every MoE layer, forward: 2bshE per layer. A mixture-of-experts
    layer's MLP counts the active experts only (top-k routed + shared: ModelSpec.compute_view), the
    FLOPs a token really costs (6 x active parameters per token, as MoE papers report MFU)."""
    return 2.0 * b * s * model.hidden_size * model.num_experts * model.num_moe_layers


def recompute_flops_per_step(model: ModelSpec, training: TrainingSpec, recompute: np.ndarray) -> np.ndarray:
    """Extra forward FLOPs of activation recomputation over the global batch.

    full: the whole layer forward again (Narayanan 2021 Eq. 3 counts 4 passes);
    selective: the attention core only (Korthikanti 2022 Eq. 8 adds 4bs^2h per layer).
    """
    b, s, L = training.global_batch_size, training.seq_len, model.num_layers
    model = model.compute_view()
    full = L * layer_forward_flops(model, s, b)
    selective = L * attention_core_flops(model, s, b)
    return np.where(recompute == RECOMPUTE_FULL, full, np.where(recompute == RECOMPUTE_SELECTIVE, selective, 0.0))
