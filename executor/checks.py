"""What the executor can run, checked without torch (so `berth validate` refuses a bad plan
before anything is launched, and the planner never imports torch)."""

from __future__ import annotations

from planner import stages
from planner.specs import Layout, ModelSpec, TrainingSpec

PROGRESS_PREFIX = "BERTH_PROGRESS "  # rank 0's per-step line, read by `berth validate` for its progress display
REQUIRE_GPU_ENV = "BERTH_REQUIRE_GPU"  # `berth validate` sets it to 1 for a GPU plan: no CPU stand-in


class UnsupportedLayout(ValueError):
    """The layout cannot run on this model with this executor (raised before any collective)."""


def check_layout(spec: ModelSpec, training: TrainingSpec, layout: Layout, world: int) -> None:
    """Everything that would make the run fail or train wrongly, said before it starts."""
    problems = []
    if layout.world_size != world:
        problems.append(f"layout needs {layout.world_size} processes (tp x cp x pp x dp), the launch has {world}")
    if layout.cp > 1 and training.seq_len % (2 * layout.cp):
        problems.append(f"cp={layout.cp} needs seq_len {training.seq_len} divisible by 2 x cp (load-balanced chunks)")
    if spec.num_attention_heads % layout.tp or spec.kv_heads % layout.tp:
        problems.append(f"tp={layout.tp} does not divide the {spec.num_attention_heads} heads / "
                        f"{spec.kv_heads} kv heads")
    if spec.ffn_hidden_size % layout.tp or spec.vocab_size % layout.tp:
        problems.append(f"tp={layout.tp} does not divide ffn {spec.ffn_hidden_size} or vocab {spec.vocab_size}")
    if layout.sequence_parallel and (training.seq_len // layout.cp) % layout.tp:
        problems.append(f"sequence parallel needs tp={layout.tp} to divide the {training.seq_len // layout.cp} "
                        "tokens of each sequence on a rank")
    if not stages.split(spec.num_layers, layout.pp, layout.virtual_stages)[3]:
        problems.append(stages.why_invalid(spec.num_layers, layout.pp, layout.virtual_stages))
    if spec.tied_embeddings and (layout.pp > 1 or layout.tp > 1):
        problems.append("tied embeddings with tp or pp > 1 are not supported by the executor")
    if layout.dp % layout.shard:
        problems.append(f"shard={layout.shard} does not divide dp={layout.dp}")
    if layout.virtual_stages > 1 and layout.schedule != "interleaved_1f1b":
        problems.append(f"virtual_stages={layout.virtual_stages} needs schedule interleaved_1f1b")
    if layout.pp > 1 and layout.schedule != "gpipe" and layout.num_microbatches < layout.pp:
        problems.append(f"{layout.schedule} needs num_microbatches >= pp ({layout.num_microbatches} < {layout.pp})")
    rows = layout.dp * layout.micro_batch_size * layout.num_microbatches
    if rows != training.global_batch_size:
        problems.append(f"dp x micro_batch_size x num_microbatches = {rows} != global_batch_size "
                        f"{training.global_batch_size}")
    if layout.ep > 1 and (not spec.num_experts or spec.num_experts % layout.ep or layout.dp % layout.ep):
        problems.append(f"ep={layout.ep} must divide dp={layout.dp} and the {spec.num_experts} experts (MoE only)")
    if spec.num_experts and (layout.tp > 1 or layout.pp > 1 or layout.cp > 1 or layout.zero_stage > 0):
        problems.append("the executor runs mixture-of-experts models on dp (with ep) only: tp = cp = pp = 1, zero 0")
    if problems:
        raise UnsupportedLayout(f"layout {layout.short()}: " + "; ".join(problems))
