"""Why a layout cannot run: the one table of layout rules, evaluated vectorized.

Each rule of `RULES` is a vectorized predicate over `Candidates` (True: the candidate breaks it),
a reason code (its name), the general statement of it (`text`: the plan's infeasible_reason and
the search's rejection counts) and the statement in one layout's numbers (`detail`, with the values
that would do where they are few). Everything that checks a layout evaluates this table and
nothing else: the search's mask (`structural_reasons`) and its pruning (planner/search.py
`_structural_rows` through `prune`), `compare` / `--layout` / `--fix` (specs/layouts.py through
`violations`), the API (the same functions), and the executor's pre-flight check
(executor/checks.py, `violations(..., who=EXECUTOR)`).

`applies` says whom a rule binds: PLAN (what berth plans and the engines run: the search,
`compare`, the API) and/or EXECUTOR (what the bundled torch.distributed executor runs: `berth
validate`, executor/train.py). A rule that only the bundled executor has (it splits the
feed-forward layer evenly, for instance) is tagged EXECUTOR alone: the planner still plans
such a layout, and `berth validate` says why this executor cannot run it.

An infeasible candidate is a mask plus a reason, never an exception (DESIGN convention 4).
Code 0 means valid; otherwise the first failing rule in REASONS order is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from math import gcd

import numpy as np

from berth.specs import stages
from berth.specs.candidates import SCHEDULE_INTERLEAVED, Candidates
from berth.specs.engines import ENGINE_RULE_NAMES, ENGINES, RULE_BY_NAME, refusal_text, rule_broken, split_rule
from berth.specs.tree import AXIS_ORDER_CHOICES, LAYOUT_FIELDS, ClusterSpec, Layout, ModelSpec, TrainingSpec

VALID = 0
# The smallest load-balanced chunk (seq_len / (2 cp) tokens) a layout may use: below it each ring
# step's attention block is too small to hide its KV transfer, and flash kernels tile by 64-128.
# 16 keeps tiny test models (seq 64, cp 2) valid; the search asks much more (planner/search.py).
CP_MIN_CHUNK_TOKENS = 16
# the axis orders with pp outermost (the expert groups of expert_tp < tp lie inside one pipeline stage's ranks)
PP_OUTERMOST = [i for i, o in enumerate(AXIS_ORDER_CHOICES) if o.endswith("-pp")]

PLAN = "plan"  # berth's plans: the search's mask and pruning, compare / --layout / --fix, the API
EXECUTOR = "executor"  # the bundled executor's pre-flight check (berth validate, executor/train.py)
BOTH = frozenset({PLAN, EXECUTOR})
MAX_LISTED = 12  # valid values listed in a refusal before "..."


@dataclass(frozen=True)
class Facts:
    """What the rules read besides the layout: the model, the training, the ranks there are; for
    the explanations, the layout fields a user gave (`--layout`, `--fix`) and what a rank is."""

    model: ModelSpec
    training: TrainingSpec
    world: int
    given: frozenset[str] = frozenset(LAYOUT_FIELDS)
    ranks: str = "GPUs"

    @classmethod
    def of(cls, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, **kw) -> Facts:
        return cls(model, training, cluster.world_size, **kw)


@dataclass(frozen=True)
class Rule:
    name: str  # the reason code
    reads: tuple[str, ...]  # the Layout fields the predicate reads (a refusal blames these)
    broken: Callable[[Candidates, Facts], np.ndarray]  # vectorized: True where a candidate breaks it
    text: str  # the rule in general
    detail: Callable[[Layout, Facts], str] | None = None  # the rule in one layout's numbers (None: text)
    applies: frozenset[str] = BOTH

    def explain(self, x: Layout, f: Facts) -> str:
        return self.detail(x, f) if self.detail is not None else self.text


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def listing(values: list) -> str:
    return ", ".join(map(str, values[:MAX_LISTED])) + (", ..." if len(values) > MAX_LISTED else "")


# --- the details: each rule in the user's numbers, with the valid values where they are few ---


def _world(x: Layout, f: Facts) -> str:
    cp = x.cp > 1 or "cp" in f.given  # the product names cp only where the layout has it
    if "dp" in f.given:
        return f"tp x {'cp x ' if cp else ''}pp x dp = {x.world_size} must equal the {f.world} {f.ranks}"
    return f"tp x {'cp x ' if cp else ''}pp = {x.tp * x.cp * x.pp} must divide the {f.world} {f.ranks}"


def _tp_heads(x: Layout, f: Facts) -> str:
    a, kv = f.model.num_attention_heads, f.model.kv_heads
    valid = [d for d in divisors(gcd(a, kv)) if f.world % d == 0]
    return f"tp must divide the {a} attention heads and {kv} kv heads; valid: {listing(valid)}"


def _cp_chunks(x: Layout, f: Facts) -> str:
    s = f.training.seq_len
    valid = [1] + [d for d in divisors(f.world) if d > 1 and s % (2 * d) == 0 and s // (2 * d) >= CP_MIN_CHUNK_TOKENS]
    return (
        f"context parallelism splits each sequence into 2 x cp chunks of at least {CP_MIN_CHUNK_TOKENS} "
        f"tokens: seq_len {s} / (2 x {x.cp}) does not; valid: {listing(valid)}"
    )


def _split_valid(pp, vpp, f: Facts) -> np.ndarray:
    """Where the engine's own split (EngineInfo.split: berth's, or nanotron's compute-balanced one) gives every
    pipeline stage a decoder layer (specs/stages.py)."""
    return np.asarray(stages.rule_stage_split(f.model, pp, vpp, split_rule(f.training))[3])


def _stages(x: Layout, f: Facts) -> str:
    L = f.model.num_layers
    valid = [d for d in divisors(f.world // (x.tp * x.cp)) if _split_valid(d, x.virtual_stages, f)]
    why = stages.why_invalid(L, x.pp, x.virtual_stages, split_rule(f.training))
    return f"{why}; valid pp (vpp={x.virtual_stages}): {listing(valid)}"


def _batch(x: Layout, f: Facts) -> str:
    return (
        f"dp x micro_batch_size x num_microbatches = {x.dp} x {x.micro_batch_size} x "
        f"{x.num_microbatches} = {x.dp * x.micro_batch_size * x.num_microbatches} must equal the "
        f"global batch {f.training.global_batch_size}"
    )


def _interleaved(x: Layout, f: Facts) -> str:
    if x.pp == 1:
        return "virtual stages split a pipeline stage: interleaved_1f1b and vpp > 1 need pp > 1"
    return "interleaved_1f1b needs virtual_stages > 1"


def _ep_dp(x: Layout, f: Facts) -> str:
    if x.etp == x.tp:
        valid = divisors(gcd(x.dp, f.model.num_experts or 1))
        return (
            f"ep = {x.ep} must divide dp = {x.dp} (expert-parallel ranks are carved out of the data-parallel "
            f"ranks); valid: {listing(valid)}"
        )
    valid = divisors(gcd(x.tp * x.dp // max(x.etp, 1), f.model.num_experts or 1))
    return (
        f"ep x expert_tp = {x.ep} x {x.etp} must divide tp x dp = {x.tp} x {x.dp} (Megatron-LM's expert ranks "
        f"cover the attention's tp x dp ranks); valid ep: {listing(valid)}"
    )


def _etp_values(x: Layout, f: Facts) -> str:
    return (
        f"expert_tp = {x.etp} must divide tp = {x.tp} (1: whole experts per rank, MoE parallel folding; tp: the "
        f"experts split as the dense layers); valid: {listing(divisors(x.tp))}"
    )


def _etp(c: Candidates) -> np.ndarray:
    """The candidates whose experts run with their own tensor-parallel size (expert_tp < tp)."""
    return c.expert_tp != c.tp


_RULES_BEFORE_MEMORY: tuple[Rule, ...] = (
    Rule(
        "world_size_mismatch",
        ("tp", "cp", "pp", "dp"),
        lambda c, f: c.tp * c.cp * c.pp * c.dp != f.world,
        "tp x cp x pp x dp must equal the number of GPUs",
        _world,
    ),
    Rule(
        "tp_not_divide_heads",
        ("tp",),
        lambda c, f: f.model.num_attention_heads % c.tp != 0,
        "tp must divide the attention heads",
        _tp_heads,
    ),
    Rule(
        "tp_not_divide_kv_heads",
        ("tp",),
        lambda c, f: f.model.kv_heads % c.tp != 0,
        "tp must divide the key/value heads",
        _tp_heads,
    ),
    Rule(
        "cp_not_divide_seq",
        ("cp",),
        lambda c, f: (c.cp > 1) & (f.training.seq_len % (2 * c.cp) != 0),
        "context parallelism splits each sequence into 2 x cp chunks (load-balanced causal split): seq_len must "
        "be divisible by 2 x cp",
        _cp_chunks,
    ),
    # engines only: the bundled executor runs any chunk and attends without flash kernels
    Rule(
        "cp_chunk_too_small",
        ("cp",),
        lambda c, f: (c.cp > 1) & (f.training.seq_len // (2 * c.cp) < CP_MIN_CHUNK_TOKENS),
        f"context parallelism needs chunks of seq_len / (2 x cp) >= {CP_MIN_CHUNK_TOKENS} tokens",
        _cp_chunks,
        applies=frozenset({PLAN}),
    ),
    Rule(
        "cp_needs_flash_attention",
        ("cp",),
        lambda c, f: (c.cp > 1) & (not f.training.flash_attention),
        "context parallelism (ring attention) runs on flash attention: cp > 1 needs training.flash_attention",
        lambda x, f: (
            f"cp = {x.cp} > 1 runs ring attention on flash attention kernels: it needs training.flash_attention"
        ),
        applies=frozenset({PLAN}),
    ),
    Rule(
        "stage_without_layers",
        ("pp", "virtual_stages"),
        lambda c, f: ~_split_valid(c.pp, c.virtual_stages, f),
        "the engine's layer split over pp x virtual_stages leaves a pipeline stage without a layer (specs/stages.py)",
        _stages,
    ),
    Rule(
        "batch_not_divisible",
        ("dp", "micro_batch_size", "num_microbatches"),
        lambda c, f: c.dp * c.micro_batch_size * c.num_microbatches != f.training.global_batch_size,
        "dp x micro_batch_size x num_microbatches must equal the global batch",
        _batch,
    ),
    Rule(
        "shard_not_divide_dp",
        ("shard", "dp"),
        lambda c, f: c.dp % c.shard != 0,
        "shard must divide dp",
        lambda x, f: f"shard must divide dp = {x.dp}; valid: {listing(divisors(x.dp))}",
    ),
    Rule(
        "shard_without_zero",
        ("shard", "zero_stage"),
        lambda c, f: (c.zero_stage == 0) & (c.shard > 1),
        "shard > 1 needs zero_stage >= 1",
        lambda x, f: f"shard = {x.shard} > 1 needs zero >= 1 (sharding is what ZeRO does)",
    ),
    Rule(
        "virtual_stages_need_interleaved",
        ("virtual_stages", "schedule"),
        lambda c, f: (c.virtual_stages > 1) & (c.schedule != SCHEDULE_INTERLEAVED),
        "virtual_stages > 1 needs schedule interleaved_1f1b",
        lambda x, f: f"virtual_stages = {x.virtual_stages} > 1 needs schedule interleaved_1f1b",
    ),
    Rule(
        "interleaved_needs_virtual_stages",
        ("schedule", "virtual_stages", "pp"),
        lambda c, f: (c.schedule == SCHEDULE_INTERLEAVED) & ((c.virtual_stages == 1) | (c.pp == 1)),
        "interleaved_1f1b needs virtual_stages > 1 and pp > 1",
        _interleaved,
    ),
    Rule(
        "sequence_parallel_needs_tp",
        ("sequence_parallel", "tp"),
        lambda c, f: (c.sequence_parallel > 0) & (c.tp == 1),
        "sequence_parallel needs tp > 1",
        lambda x, f: "sequence parallelism splits the tensor-parallel group's activations: it needs tp > 1",
    ),
    Rule(
        "ep_needs_moe",
        ("ep",),
        lambda c, f: (c.ep > 1) & (f.model.num_experts == 0),
        "ep > 1 needs a mixture-of-experts model (num_experts > 0)",
        lambda x, f: f"ep = {x.ep} > 1 needs a mixture-of-experts model; {f.model.name} is dense (num_experts 0)",
    ),
    Rule(
        "ep_not_divide_experts",
        ("ep",),
        lambda c, f: (c.ep > 1) & (f.model.num_experts % np.maximum(c.ep, 1) != 0),
        "ep must divide num_experts (each ep rank holds num_experts / ep experts)",
        lambda x, f: (
            f"ep must divide the {f.model.num_experts} experts; valid: {listing(divisors(f.model.num_experts))}"
        ),
    ),
    Rule(
        "expert_tp_not_divide_tp",
        ("expert_tp", "tp"),
        lambda c, f: c.tp % np.maximum(c.expert_tp, 1) != 0,
        "expert_tp must divide tp (the expert-tp group is consecutive ranks inside the attention's tp group)",
        _etp_values,
    ),
    Rule(
        "expert_tp_needs_moe",
        ("expert_tp", "tp"),
        lambda c, f: _etp(c) & (f.model.num_experts == 0),
        "expert_tp != tp needs a mixture-of-experts model (num_experts > 0)",
        lambda x, f: (
            f"expert_tp = {x.etp} != tp = {x.tp} splits routed experts; {f.model.name} is dense (num_experts 0)"
        ),
    ),
    Rule(
        "expert_tp_needs_sequence_parallel",
        ("expert_tp", "sequence_parallel"),
        lambda c, f: _etp(c) & (c.sequence_parallel == 0),
        "expert_tp < tp needs sequence parallelism: each tp rank routes its own seq / tp tokens to whole "
        "experts (Megatron-LM requires sequence parallelism for MoE with tp: moe_layer.py, yaml_arguments.py)",
        lambda x, f: (
            f"expert_tp = {x.etp} < tp = {x.tp}: each tp rank routes its own seq / tp tokens to whole experts, "
            "which needs sequence parallelism (sp=1)"
        ),
    ),
    Rule(
        "expert_tp_needs_pp_outermost",
        ("expert_tp", "pp", "axis_order"),
        lambda c, f: _etp(c) & (c.pp > 1) & ~np.isin(c.axis_order, PP_OUTERMOST),
        "expert_tp < tp places the ep group on consecutive ranks of tp x dp: with pp > 1 pp must be the "
        "outermost axis (Megatron-LM's initialize_model_parallel asserts the pp-last order when the experts' "
        "data-parallel size differs from the attention's)",
        lambda x, f: (
            f"expert_tp = {x.etp} < tp = {x.tp} with pp = {x.pp}: the expert groups need pp outermost; valid "
            f"axis_order: {listing([AXIS_ORDER_CHOICES[i] for i in PP_OUTERMOST])}"
        ),
    ),
    Rule(
        "ep_not_divide_dp",
        ("ep", "dp", "expert_tp", "tp"),
        lambda c, f: (c.tp * c.dp) % (np.maximum(c.ep, 1) * np.maximum(c.expert_tp, 1)) != 0,
        "ep x expert_tp must divide tp x dp (expert_tp = tp: ep divides dp, the expert-parallel ranks carved out "
        "of the data-parallel ranks; Megatron-LM's initialize_model_parallel: world % (expert_tp x ep x pp) = 0)",
        _ep_dp,
    ),
    Rule(
        "ep_with_cp",
        ("ep", "cp", "expert_tp"),
        lambda c, f: ((c.ep > 1) | _etp(c)) & (c.cp > 1),
        "ep > 1 or expert_tp < tp with cp > 1 is not modelled (Megatron-LM and torchtitan fold the cp ranks "
        "into the expert-parallel group; berth carves ep out of tp x dp only)",
    ),
)


# What the bundled executor cannot run and the engines can (executor/parallel.py, executor/model.py).
def _engine_rule(name: str, engine: str | None = None) -> Rule:
    """A rule of the engine table (specs/engines.py) as a layout rule: for the plan, the rule of the
    training's engine; with `engine`, that engine's (the bundled executor's pre-flight check)."""
    r = RULE_BY_NAME[name]

    def detail(x: Layout, f: Facts) -> str:
        return refusal_text(engine or f.training.engine, r.detail(x, f.model, f.training))

    return Rule(
        name if engine is None else f"{engine}_{name}",
        r.reads,
        lambda c, f: rule_broken(name, c, f.model, f.training, engine),
        r.text,
        detail,
        applies=frozenset({PLAN}) if engine is None else frozenset({EXECUTOR}),
    )


# what each engine can run (the training's engine binds the plan; the bundled executor's pre-flight adds its own)
_ENGINE_RULES: tuple[Rule, ...] = tuple(_engine_rule(n) for n in ENGINE_RULE_NAMES)
_EXECUTOR_ENGINE_RULES: tuple[Rule, ...] = tuple(_engine_rule(r.name, "executor") for r in ENGINES["executor"].rules)

_EXECUTOR_RULES: tuple[Rule, ...] = (
    Rule(
        "tp_not_divide_ffn",
        ("tp",),
        lambda c, f: f.model.ffn_hidden_size % c.tp != 0,
        "the bundled executor splits the feed-forward layer evenly over tp: tp must divide ffn_hidden_size",
        lambda x, f: (
            f"tp={x.tp} does not divide ffn {f.model.ffn_hidden_size} (the bundled executor splits the "
            "feed-forward layer evenly)"
        ),
        applies=frozenset({EXECUTOR}),
    ),
    Rule(
        "sequence_parallel_tokens",
        ("sequence_parallel", "tp", "cp"),
        lambda c, f: (c.sequence_parallel > 0) & ((f.training.seq_len // c.cp) % c.tp != 0),
        "the bundled executor's sequence parallelism needs tp to divide the tokens of each sequence on a rank",
        lambda x, f: (
            f"sequence parallel needs tp={x.tp} to divide the {f.training.seq_len // x.cp} tokens of "
            "each sequence on a rank"
        ),
        applies=frozenset({EXECUTOR}),
    ),
    Rule(
        "tied_embeddings_model_parallel",
        ("tp", "pp"),
        lambda c, f: f.model.tied_embeddings & ((c.tp > 1) | (c.pp > 1)),
        "tied embeddings with tp or pp > 1 are not supported by the executor",
        applies=frozenset({EXECUTOR}),
    ),
    Rule(
        "expert_tp_in_executor",
        ("expert_tp", "tp"),
        lambda c, f: _etp(c),
        "the bundled executor splits experts as the dense layers: expert_tp must equal tp",
        lambda x, f: (
            f"expert_tp = {x.etp} != tp = {x.tp}: the bundled executor runs mixture of experts on dp only and "
            "splits experts as the dense layers (plan it for Megatron-LM)"
        ),
        applies=frozenset({EXECUTOR}),
    ),
    Rule(
        "moe_beyond_dp",
        ("tp", "cp", "pp", "zero_stage"),
        lambda c, f: (f.model.num_experts > 0) & ((c.tp > 1) | (c.pp > 1) | (c.cp > 1) | (c.zero_stage > 0)),
        "the executor runs mixture-of-experts models on dp (with ep) only: tp = cp = pp = 1, zero 0",
        applies=frozenset({EXECUTOR}),
    ),
)

_MEMORY: tuple[tuple[str, str], ...] = (
    ("out_of_memory", "predicted peak memory exceeds the device memory"),
    ("memory_tight", "predicted peak memory is within the memory headroom of the device memory"),
)

# The one table, in reporting order (the first broken rule is a candidate's reason). The memory
# reasons come from the cost model (cost_models/step.py) and sit between the structural rules and
# the executor-only ones, so the search's codes do not depend on the executor's rules.
RULES: tuple[Rule, ...] = _RULES_BEFORE_MEMORY + _ENGINE_RULES + _EXECUTOR_ENGINE_RULES + _EXECUTOR_RULES
RULE: dict[str, Rule] = {r.name: r for r in RULES}
REASONS: tuple[tuple[str, str], ...] = (
    (("", ""),)
    + tuple((r.name, r.text) for r in _RULES_BEFORE_MEMORY + _ENGINE_RULES)
    + _MEMORY
    + tuple((r.name, r.text) for r in _EXECUTOR_ENGINE_RULES + _EXECUTOR_RULES)
)
REASON_CODES = {name: i for i, (name, _) in enumerate(REASONS)}
OUT_OF_MEMORY = REASON_CODES["out_of_memory"]
MEMORY_TIGHT = REASON_CODES["memory_tight"]  # fits, but closer to the capacity than the search's memory headroom
# what the rules let run, whatever the memory model says of it (a measured run is scored, a probe proposed, by these)
RUNS_MEMORY_ASIDE = (VALID, MEMORY_TIGHT, OUT_OF_MEMORY)
PLAN_RULES: tuple[Rule, ...] = tuple(r for r in RULES if PLAN in r.applies)
EXECUTOR_RULES: tuple[Rule, ...] = tuple(r for r in RULES if EXECUTOR in r.applies)
_WHO = {PLAN: PLAN_RULES, EXECUTOR: EXECUTOR_RULES}


def evaluate_rules(c: Candidates, facts: Facts, rules: tuple[Rule, ...] = PLAN_RULES) -> list[np.ndarray]:
    """One boolean array per rule (True: the candidate breaks it), vectorized over the candidates."""
    n = len(c)
    return [np.broadcast_to(np.asarray(r.broken(c, facts), dtype=bool), (n,)) for r in rules]


def structural_rules(c: Candidates, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> list:
    """One boolean array per PLAN rule (True: the candidate breaks it), in REASONS order."""
    return evaluate_rules(c, Facts.of(model, training, cluster))


def structural_reasons(c: Candidates, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> np.ndarray:
    """Reason codes for every PLAN rule (none depends on the cost model): the first broken wins."""
    return reason_codes(c, Facts.of(model, training, cluster))


def reason_codes(c: Candidates, facts: Facts) -> np.ndarray:
    """Each candidate's reason code: the first PLAN rule it breaks, VALID (0) where none."""
    rules = evaluate_rules(c, facts)
    reason = np.zeros(len(c), dtype=np.int64)
    for rule, broken in zip(reversed(PLAN_RULES), reversed(rules), strict=True):  # the first failing rule wins
        reason = np.where(broken, REASON_CODES[rule.name], reason)
    return reason


def violations(layout: Layout, facts: Facts, who: str = PLAN) -> list[tuple[Rule, str]]:
    """(rule, the rule in the layout's numbers) of every rule of `who` the one layout breaks, in
    table order: the vectorized predicates evaluated on a one-row Candidates."""
    rules = _WHO[who]
    broken = evaluate_rules(Candidates.from_layouts([layout]), facts, rules)
    return [(r, r.explain(layout, facts)) for r, b in zip(rules, broken, strict=True) if b[0]]


def prune(facts: Facts, **columns: np.ndarray) -> np.ndarray:
    """Rows of partial candidates (some Candidates columns given, the others at Layout's defaults)
    that break no PLAN rule reading only the given fields: the search's pruning before it builds the
    full candidates (a rule that reads a field still free cannot be judged yet)."""
    n = len(next(iter(columns.values())))
    default = Candidates.from_layouts([Layout()])
    c = Candidates(
        **{f.name: np.repeat(getattr(default, f.name), n) for f in fields(Candidates)}
        | {k: np.asarray(v, dtype=np.int64) for k, v in columns.items()}
    )
    known = set(columns)  # Candidates columns are named as the Layout fields
    rules = tuple(r for r in PLAN_RULES if set(r.reads) <= known)
    keep = np.ones(n, dtype=bool)
    for broken in evaluate_rules(c, facts, rules):
        keep &= ~broken
    return keep


def describe(code: int) -> str:
    name, text = REASONS[code]
    return f"{name}: {text}" if name else ""
