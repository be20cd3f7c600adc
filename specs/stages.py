"""Decoder layers per pipeline stage: berth's rule, used by the cost model (cost_models/step.py, memory.py), the
validity rules (specs/validity.py), the search (planner/search.py), the executor (executor/parallel.py, checks.py)
and the launch artifacts (launch/writers.py) of every engine but one; nanotron's own rule is at the end.

The rule. pp ranks with v virtual stages each cut the model into S = pp x v chunks, in model order
(chunk c runs on pp rank c mod pp: the interleaved order of Megatron-LM and of
torch.distributed.pipelining). When S divides the L decoder layers every chunk holds L / S. Otherwise
every chunk but the first and the last holds k = ceil(L / S) and the first and the last give up the
r = S k - L layers that are missing: the last chunk ceil(r / 2), the first floor(r / 2). A split that
would leave the first or the last chunk without a decoder layer (S > L among them) is refused
(`split`'s `valid`; validity reason `stage_without_layers`).

Why this split:
- the slowest stage sets the step (every stage runs each micro-batch at the pace of the slowest) and
  the largest sets the memory: no split gives its largest chunk fewer than ceil(L / S) layers, and
  this one gives that to every middle chunk and less to the two ends;
- the ends carry more than their layers: the first the embedding (a lookup, but under 1F1B the most
  micro-batches in flight), the last the final norm, the LM head and the loss (2 h V FLOPs per token
  forward, a large share of a layer when the vocabulary is large, and the logits in memory), so the
  last gives up the larger half;
- it is the split Meta trained Llama 3 405B with: 126 layers on PP 16, "we reduce one Transformer
  layer each from the first and the last stages" (The Llama 3 Herd of Models, 2024, Sec. 3.3.2;
  Table 4: TP 8, CP 1, PP 16): 7, 8 x 14, 7 here;
- every engine berth launches builds it as such:
  Megatron-LM (main @ d98e8a6) `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`
  for v = 1; TransformerConfig.__post_init__ ("Uneven PP") requires the remaining layers to divide
  evenly among the middle stages, which they do (k each); for v > 1 its first/last counts apply to
  every chunk of the first/last rank, so the chunk split is written as `--pipeline-model-parallel-layout`
  (megatron/core/transformer/pipeline_parallel_layer_layout.py);
  torchtitan (torchtitan/distributed/pipeline_parallel.py `_get_pipeline_metadata`,
  `_generate_llm_fqn_per_model_part`): S = ceil((L + first_less + last_less) / layers_per_stage)
  chunks of layers_per_stage effective layers, the first holding first_less and the last last_less
  fewer; `pipeline_parallel_layers_per_stage = k` with `first/last_stage_less_layers = k - first,
  k - last` gives exactly these chunks;
  torch.distributed.pipelining (the bundled executor): any split;
  DeepSpeed's PipelineModule partitions by its own method (`uniform` puts the remainder on the
  first stages), so launch/writers.py refuses uneven stages for it.

One engine splits by a rule of its own, and berth predicts its layouts with that rule
(`SPLIT_COMPUTE_BALANCED`, EngineInfo.split): nanotron (models/base.py `build_model` at e24d2483)
walks its pipeline blocks in model order (the embedding, the L decoder layers, the final norm,
the LM head, the fp32 cast, the loss) with a compute cost each (models/llama.py
`get_block_compute_costs`: a decoder layer 4 heads head_dim h + 3 ffn h, the LM head V h, every
other block 0) and puts a block on the current rank, moving to the next rank once the running sum
passes (rank + 1) / pp of the total. Rank 0 thus holds more layers than the others (the sweep's
1B, vocabulary 131,072: 11 and 5 at pp 2) and, in deep pipelines, the head takes a rank of its own
and the cast and the loss the last ones (its 8B at pp 32: 2, 1 x 13, 2, 1 x 13, 2 layers, then the
head, the cast, the loss). Its (first, middle, last) are the layers of rank 0, of the fullest rank
between it and the head's, and of the head's rank. `valid`: no rank left without a block (405B's 126 layers fill 128;
the 1B's 16 leave pp 16's last empty: build_model makes it output_pp_rank, whose logging raises, trainer.py loss_avg
None .item(); 51 of the sweep's 52 such configurations crashed). `stage_without_layers` reads this split.
"""

from __future__ import annotations

import functools

import numpy as np

StageSplit = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (first, middle, last, valid), broadcast

SPLIT_ENDS_LIGHTER = "ends_lighter"  # berth's rule (the module docstring); every engine's but nanotron's
SPLIT_COMPUTE_BALANCED = "compute_balanced"  # nanotron's build_model
TABULATE_FROM = 256  # candidate arrays at least this long are answered from a table over (pp, vpp)


def _tabulated(rule, num_layers, pp, vpp) -> StageSplit | None:
    """`rule` over long candidate arrays, evaluated once per (pp, vpp) pair on a small grid and gathered (the search
    asks for 10^5 candidates with a handful of distinct degrees); the same arrays as `rule` on the inputs, or None where
    the inputs are not a layer count and long arrays of positive degrees."""
    pp, vpp = np.asarray(pp), np.asarray(vpp)
    if np.ndim(num_layers) or max(pp.size, vpp.size) < TABULATE_FROM or pp.min() < 1 or vpp.min() < 1:
        return None
    width = int(vpp.max()) + 1
    grid_pp, grid_vpp = np.meshgrid(np.arange(int(pp.max()) + 1), np.arange(width), indexing="ij")
    grid_pp[0], grid_vpp[:, 0] = 1, 1  # unused rows (degree 0), kept valid for the rule
    table = rule(num_layers, grid_pp, grid_vpp)
    flat = pp.astype(np.int64, copy=False) * width + vpp.astype(np.int64, copy=False)  # one gather index
    return tuple(np.take(np.broadcast_to(t, grid_pp.shape).ravel(), flat) for t in table)


def split(num_layers, pp, vpp=1) -> StageSplit:
    """(first, middle, last, valid) decoder layers of the first, every middle and the last chunk (virtual stage) for L =
    `num_layers` over pp x vpp chunks (module docstring): int64 arrays broadcast over the inputs. With one chunk all
    three are L. `valid` is False where the first or the last chunk would hold no layer."""
    return _tabulated(_split, num_layers, pp, vpp) or _split(num_layers, pp, vpp)


def _split(num_layers, pp, vpp) -> StageSplit:
    L = np.asarray(num_layers, dtype=np.int64)
    chunks = np.asarray(pp, dtype=np.int64) * np.asarray(vpp, dtype=np.int64)
    k = -(-L // chunks)  # ceil(L / S): every middle chunk
    missing = chunks * k - L
    first = np.where(chunks == 1, L, k - missing // 2)
    last = np.where(chunks == 1, L, k - (missing + 1) // 2)
    middle = np.where(chunks == 1, L, k)
    return first, middle, last, (first >= 1) & (last >= 1)


def stage_split(num_layers, pp, vpp=1) -> StageSplit:
    """(first, middle, last, valid) decoder layers of the first, every middle and the last pipeline
    rank (a rank holds vpp chunks: the first rank chunk 0 and vpp - 1 middle chunks, the last rank
    vpp - 1 middle chunks and the last chunk); with pp = 1 all three are L."""
    return _tabulated(_stage_split, num_layers, pp, vpp) or _stage_split(num_layers, pp, vpp)


def _stage_split(num_layers, pp, vpp) -> StageSplit:
    first, middle, last, valid = _split(num_layers, pp, vpp)
    v = np.asarray(vpp, dtype=np.int64)
    one = np.asarray(pp) == 1
    L = np.asarray(num_layers, dtype=np.int64)
    return (
        np.where(one, L, first + (v - 1) * middle),
        np.where(one, L, v * middle),
        np.where(one, L, last + (v - 1) * middle),
        valid,
    )


def balanced_blocks(num_layers: int, layer_cost: int, head_cost: int, pp: int) -> list[list[str]]:
    """nanotron's placement of its pipeline blocks (module docstring): per rank (of pp; past one more than the blocks,
    the empty ones left out: pp may be 2^26) the blocks it holds in model order ("embedding", "layer", "norm", "head",
    "cast", "loss"), by build_model's comparison of integer costs (cumulative cost > total x (rank + 1) / pp)."""
    kinds = ["embedding", *["layer"] * num_layers, "norm", "head", "cast", "loss"]
    costs = np.cumsum([{"layer": layer_cost, "head": head_cost}.get(k, 0) for k in kinds])
    ranks: list[list[str]] = [[] for _ in range(min(pp, len(kinds) + 1))]
    at = 0
    for kind, cumulative in zip(kinds, costs, strict=True):
        ranks[at].append(kind)
        if cumulative > costs[-1] * ((at + 1) / pp):
            at += 1
    return ranks


def nanotron_costs(model) -> tuple[int, int]:
    """(decoder layer, LM head) compute costs of nanotron's LlamaModel.get_block_compute_costs for a
    model spec (duck-typed: hidden_size, num_attention_heads, ffn_hidden_size, vocab_size)."""
    h, heads = int(model.hidden_size), int(model.num_attention_heads)
    return 4 * heads * (h // heads) * h + 3 * int(model.ffn_hidden_size) * h, int(model.vocab_size) * h


@functools.lru_cache(maxsize=1024)  # pure in its four integers; a fit evaluates the same few thousands of times
def _balanced_one(num_layers: int, layer_cost: int, head_cost: int, pp: int) -> tuple[int, int, int, bool]:
    if pp == 1:
        return num_layers, num_layers, num_layers, True
    ranks = balanced_blocks(num_layers, layer_cost, head_cost, pp)
    layers = [r.count("layer") for r in ranks]
    head = next(i for i, r in enumerate(ranks) if "head" in r)
    middle = max(layers[1:head], default=0)
    return layers[0], middle, layers[head], len(ranks) == pp and all(ranks)


def balanced_split(num_layers: int, layer_cost: int, head_cost: int, pp) -> StageSplit:
    """(first, middle, last, valid) of nanotron's split over candidate arrays of pp (module docstring):
    one evaluation per distinct pp, gathered."""
    pp = np.asarray(pp, dtype=np.int64)
    values, index = np.unique(pp, return_inverse=True)
    table = np.array([_balanced_one(num_layers, layer_cost, head_cost, int(p)) for p in values], dtype=np.int64)
    first, middle, last, valid = (table.reshape(-1, 4)[:, i][index].reshape(pp.shape) for i in range(4))
    return first, middle, last, valid.astype(bool)


def rule_stage_split(model, pp, vpp=1, rule: str = SPLIT_ENDS_LIGHTER) -> StageSplit:
    """`stage_split` under an engine's split rule (EngineInfo.split): berth's, or nanotron's compute-balanced
    one, row by row (nanotron has no virtual stages: it refuses vpp > 1, and berth's rule answers for such rows)."""
    ours = stage_split(model.num_layers, pp, vpp)
    if rule != SPLIT_COMPUTE_BALANCED:
        return ours
    one_chunk = np.asarray(vpp) == 1
    theirs = balanced_split(model.num_layers, *nanotron_costs(model), pp)
    return tuple(np.where(one_chunk, t, o) for t, o in zip(theirs, ours, strict=True))  # type: ignore[return-value]


def rule_stage_layers(model, pp: int, vpp: int = 1, rule: str = SPLIT_ENDS_LIGHTER) -> list[int]:
    """Layers of each pipeline rank under an engine's split rule, rank 0 first; ValueError where it is not `valid`."""
    if rule == SPLIT_COMPUTE_BALANCED and vpp == 1:
        if not _balanced_one(model.num_layers, *nanotron_costs(model), pp)[3]:  # its `valid`, one place
            raise ValueError(why_invalid(model.num_layers, pp, vpp, rule))
        return [r.count("layer") for r in balanced_blocks(model.num_layers, *nanotron_costs(model), pp)]
    return stage_layers(model.num_layers, pp, vpp)


def is_even(num_layers: int, pp: int, vpp: int = 1) -> bool:
    return num_layers % (pp * vpp) == 0


def chunk_layers(num_layers: int, pp: int, vpp: int = 1) -> list[int]:
    """Decoder layers of each of the pp x vpp chunks in model order; ValueError when the split
    leaves the first or the last chunk without a layer."""
    first, middle, last, valid = (int(a) for a in split(num_layers, pp, vpp))
    chunks = pp * vpp
    if not valid:
        raise ValueError(why_invalid(num_layers, pp, vpp))
    if chunks == 1:
        return [num_layers]
    return [first, *[middle] * (chunks - 2), last]


def stage_layers(num_layers: int, pp: int, vpp: int = 1) -> list[int]:
    """Decoder layers of each pipeline rank (the sum of its vpp chunks), rank 0 first."""
    chunks = chunk_layers(num_layers, pp, vpp)
    return [sum(chunks[r::pp]) for r in range(pp)]


def chunk_offsets(num_layers: int, pp: int, vpp: int = 1) -> list[int]:
    """The first global layer index of each chunk, and L at the end (len pp x vpp + 1)."""
    out = [0]
    for n in chunk_layers(num_layers, pp, vpp):
        out.append(out[-1] + n)
    return out


def why_invalid(num_layers: int, pp: int, vpp: int = 1, rule: str = SPLIT_ENDS_LIGHTER) -> str:
    if rule == SPLIT_COMPUTE_BALANCED and vpp == 1:  # the walk's empty ranks are its last ones
        return f"nanotron's compute-balanced split of {num_layers} layers leaves its last of {pp} ranks without a block"
    chunks = pp * vpp
    first, middle, last, _ = (int(a) for a in split(num_layers, pp, vpp))
    if chunks > num_layers:
        return f"pp x virtual_stages = {chunks} chunks for {num_layers} layers: a pipeline stage would hold no layer"
    return (
        f"{num_layers} layers over pp x virtual_stages = {chunks} chunks: the middle chunks hold "
        f"{middle} each (ceil({num_layers}/{chunks})) and the first and last would hold {first} and {last}; "
        "a stage without a decoder layer is refused"
    )
