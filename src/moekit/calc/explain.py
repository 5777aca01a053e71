"""`--explain`: the calculator's derivation as readable lines, every number shown with the
numbers it comes from, so each step can be redone by hand.

Sections: parameters of one layer (formulas.py), the whole model, the three active conventions,
memory, bytes read per decoded token, and, when asked, the roofline on a device and the latency
budget. A config carrying `_claims` (claims.py) gets one more section testing them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

from moekit.calc import units as u
from moekit.calc.claims import Claims, ShareAnalysis, share_analysis, uniform_moe
from moekit.calc.dtypes import DTYPES, dense_dtype
from moekit.calc.formulas import LayerFormula, ModelFormula, Term, model_formula, total
from moekit.calc.kv_cache import cached_tokens, kv_elems_per_token, mamba_state_elems
from moekit.calc.memory import activation_dtype_bytes, ffn_width_per_token, scores_per_token
from moekit.calc.report import ModelReport, not_fitting
from moekit.calc.roofline import Bound, params_within
from moekit.calc.traffic import expected_distinct_experts
from moekit.spec.model_spec import AttentionSpec, MoESpec

LABEL_WIDTH = 52


def _line(label: str, formula: str, value: float, indent: int = 4) -> str:
    rhs = f"{formula} = {u.n(value)}" if formula else f"= {u.n(value)}"
    return f"{' ' * indent}{label:<{LABEL_WIDTH}} {rhs}"


def _bytes_line(label: str, formula: str, value: float) -> str:
    return _line(label, formula, value) + f" B ({u.nbytes(value)})"


def _term(t: Term) -> str:
    return _line(t.label, t.formula if len(t.factors) > 1 else "", t.value)


def _layers(count: int) -> str:
    return f"{count} layer" if count == 1 else f"{count} layers"


def _ranges(indices: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) → '0-2, 5'."""
    spans, start, prev = [], indices[0], indices[0]
    for i in indices[1:] + (None,):
        if i is not None and i == prev + 1:
            prev = i
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(spans)


def _check(shown: int, counted: int, what: str) -> list[str]:
    """The formulas are a second count; say so loudly if they ever disagree with the first."""
    if shown == counted:
        return []
    return [f"    ! the formulas give {u.n(shown)} but the counter gives {what} = {u.n(counted)}"]


# -- parameters ---------------------------------------------------------------------------------


def _group_header(g: LayerFormula) -> str:
    ffn = f"MoE (E = {g.num_experts}, K = {g.top_k})" if g.num_experts else "dense MLP"
    return f"  layers {_ranges(g.indices)} ({_layers(g.count)}): {g.mixer_kind} + {ffn}"


def layer_section(f: ModelFormula) -> list[str]:
    lines = ["Parameters of one layer"]
    for g in f.groups:
        lines.append(_group_header(g))
        lines += [_term(t) for t in g.mixer]
        lines.append(_line(f"{g.mixer_kind}, one layer", "", total(g.mixer)))
        lines += [_term(t) for t in g.dense + g.router]
        if g.num_experts:
            one = total(g.expert)
            lines += [_term(t) for t in g.expert]
            lines.append(_line("routed experts, one layer  E × one expert", f"{g.num_experts} × {u.n(one)}", g.num_experts * one))
            lines.append(_line("  of which active per token  K × one expert", f"{g.top_k} × {u.n(one)}", g.top_k * one))
        lines += [_term(t) for t in g.shared + g.norms]
    return lines


def _sum_over_groups(f: ModelFormula, key: str) -> tuple[str, int]:
    """'per layer × layers + …' over the layer groups, and its value."""
    parts = [(g.per_layer().get(key, 0), g.count) for g in f.groups]
    parts = [(v, c) for v, c in parts if v]
    return " + ".join(f"{u.n(v)} × {c}" for v, c in parts), sum(v * c for v, c in parts)


WHOLE_MODEL_ROWS = {
    "attention": "attention",
    "mamba": "mamba mixers",
    "dense_mlp": "dense MLPs",
    "router": "routers",
    "routed_experts_total": "routed experts (all E)",
    "shared_experts": "shared experts",
}


def model_section(r: ModelReport, f: ModelFormula) -> list[str]:
    lines = ["Whole model (one layer's count × the layers that share it)", _term(f.embedding)]
    for key, label in WHOLE_MODEL_ROWS.items():
        formula, value = _sum_over_groups(f, key)
        if value:
            lines.append(_line(label, formula, value))
    formula, value = _sum_over_groups(f, "norms")
    lines.append(_line("norms (+ final norm)", f"{formula} + {u.n(f.final_norm.value)}", value + f.final_norm.value))
    if f.head is not None:
        lines.append(_term(f.head))
    else:
        lines.append(_line("lm_head  tied to the embedding, counted once", "", 0))
    lines.append(_line("total_params  the sum of the above", "", f.total) + f" ({u.params(f.total)})")
    lines += _check(f.total, r.counts.total_params, "total_params")
    b = r.counts.breakdown
    if b.mtp:
        lines.append(f"    apart, not in total_params: multi-token-prediction module {u.n(b.mtp)} ({u.params(b.mtp)})")
    if b.vision:
        lines.append(f"    apart, not in total_params: vision tower {u.n(b.vision)} ({u.params(b.vision)})")
    return lines


def active_section(r: ModelReport, f: ModelFormula) -> list[str]:
    c, b, tied = r.counts, r.counts.breakdown, r.spec.tie_word_embeddings
    lines = ["Active parameters per token (three published conventions)"]
    formula, routed_active = _sum_over_groups(f, "routed_experts_active")
    lines.append(_line("routed experts a token runs  K × one expert", formula, routed_active))

    active = f.total - b.routed_experts_total + routed_active
    formula = f"{u.n(f.total)} − {u.n(b.routed_experts_total)} + {u.n(routed_active)}"
    lines.append(_line("active_params  total − all routed + active routed", formula, active) + f" ({u.params(active)})")
    lines.append("      (embedding and head counted in full: Mistral, Qwen, Meta, Databricks)")
    lines += _check(active, c.active_params, "active_params")

    if tied:
        excl = active
        lines.append(_line("active_params_excl_input_embedding  = active", "", excl) + f" ({u.params(excl)})")
        lines.append("      (tied: the one table is also the output head, which every token uses)")
    else:
        excl = active - b.embedding
        formula = f"{u.n(active)} − {u.n(b.embedding)}"
        lines.append(_line("active_params_excl_input_embedding  active − V × D", formula, excl) + f" ({u.params(excl)})")
    lines.append("      (DeepSeek, OpenAI)")
    lines += _check(excl, c.active_params_excl_input_embedding, "active_params_excl_input_embedding")

    non = active - b.embedding - b.head
    label = "active_params_non_embedding  active − embedding" + ("" if tied else " − head")
    formula = f"{u.n(active)} − {u.n(b.embedding)}" + ("" if tied else f" − {u.n(b.head)}")
    lines.append(_line(label, formula, non) + f" ({u.params(non)})")
    lines += _check(non, c.active_params_non_embedding, "active_params_non_embedding")

    lines.append(f"    active_fraction  active / total = {u.n(active)} / {u.n(f.total)} = {u.pct(c.active_fraction)}")
    moe = uniform_moe(r.spec)
    if moe is not None:
        always_on = active - routed_active
        lines.append(
            f"    routing alone touches K / E = {moe.top_k} / {moe.num_experts} = {u.pct(moe.top_k / moe.num_experts)}"
            f" of the routed experts; the always-on part ({u.params(always_on)},"
            f" {u.pct(always_on / f.total)} of total) is touched by every token"
        )
    return lines


# -- memory and traffic -------------------------------------------------------------------------


def _kv_groups(r: ModelReport) -> tuple[dict[tuple[int, int], int], int, int]:
    """{(values per token, tokens kept): layers}, mamba layers, mamba state values per layer."""
    groups: dict[tuple[int, int], int] = defaultdict(int)
    mamba_layers = mamba_state = 0
    for layer in r.spec.layers:
        m = layer.mixer
        if isinstance(m, AttentionSpec):
            groups[(kv_elems_per_token(m), cached_tokens(m, r.request.context))] += 1
        else:
            mamba_layers += 1
            mamba_state = mamba_state_elems(m)
    return groups, mamba_layers, mamba_state


def _kv_per_token_formula(r: ModelReport) -> str:
    first = next((layer.mixer for layer in r.spec.layers if isinstance(layer.mixer, AttentionSpec)), None)
    if first is None:
        return ""
    if first.kind == "mla":
        return (
            f"(kv_lora_rank {first.kv_lora_rank} + rope {first.qk_rope_head_dim}) per layer"
            " (MLA caches the latent, not K and V)"
        )
    return f"2 × kv_heads {first.num_kv_heads} × head_dim {first.head_dim} per layer (K and V)"


def _weights_lines(r: ModelReport) -> list[str]:
    m, b, dt = r.memory, r.counts.breakdown, r.request.dtype
    bits, dense_bits = u.bits(dt.bits), u.bits(dense_dtype(dt).bits)
    resident = r.counts.total_params - b.routed_experts_total
    lines = [
        f"Memory at {dt.name} ({dt.convention}); bytes = params × bits / 8, rounded up",
        _bytes_line("always-resident weights  total − routed experts", f"{u.n(resident)} × {dense_bits} / 8", m.weights.resident),
        _bytes_line("routed-expert weights", f"{u.n(b.routed_experts_total)} × {bits} / 8", m.weights.routed_experts),
        _bytes_line("weights", "", m.weights.total),
    ]
    if m.weights.mtp:
        lines.append(_bytes_line("apart: MTP module (only for speculative decoding)", "", m.weights.mtp))
    return lines


def _kv_lines(r: ModelReport) -> list[str]:
    m, context = r.memory, r.request.context
    kv = DTYPES[m.kv.dtype]
    bits = u.bits(kv.bits)
    groups, mamba_layers, mamba_state = _kv_groups(r)
    lines = [f"  KV cache at {kv.name} ({bits} bits)"]
    if groups:
        per_token = sum(e * n for (e, _), n in groups.items())
        lines.append(f"    values per token: {_kv_per_token_formula(r)}")
        lines.append(_line("per token, every attention layer", f"{u.n(per_token)} values × {bits} / 8", m.kv.bytes_per_token) + " B")
        caps = sorted({t for (_, t) in groups if t < context})
        note = f" (windowed layers keep {', '.join(u.n(t) for t in caps)} tokens)" if caps else ""
        lines.append(f"    per sequence at context {u.n(context)}{note}:")
        parts = " + ".join(f"{_layers(n)} × {u.n(t)} tokens × {u.n(e)}" for (e, t), n in groups.items())
        lines.append(_bytes_line("  attention", f"({parts}) values × {bits} / 8", m.kv.attention_bytes_per_sequence))
    if mamba_layers:
        formula = f"{mamba_layers} × {u.n(mamba_state)} values × {bits} / 8"
        lines.append(_bytes_line("  mamba state  layers × d_inner × (d_conv + d_state)", formula, m.kv.state_bytes_per_sequence))
    formula = f"{u.n(m.kv.bytes_per_sequence)} × {r.request.batch}"
    lines.append(_bytes_line(f"KV cache for batch {r.request.batch}", formula, m.kv.total_bytes))
    return lines


def _activation_lines(r: ModelReport) -> list[str]:
    req, spec = r.request, r.spec
    act = activation_dtype_bytes(req.dtype)
    ffn = max(ffn_width_per_token(layer) for layer in spec.layers)
    scores = max(scores_per_token(layer, req.context) for layer in spec.layers)
    formula = (
        f"{req.batch} × ((4 × {u.n(spec.hidden_size)} + {u.n(ffn)}) × {act}"
        f" + ({u.n(scores)} + {u.n(spec.vocab_size)}) × 4)"
    )
    return [
        "  activations (rough: one layer's live tensors; per token 4 hidden vectors + the widest FFN",
        f"  intermediate at {act} B, attention scores over the context + logits at 4 B)",
        _bytes_line("batch × ((4 × D + FFN) × act + (scores + V) × 4)", formula, r.memory.activations),
        _bytes_line("total  weights + KV cache + activations", "", r.memory.total),
    ]


def memory_section(r: ModelReport) -> list[str]:
    return _weights_lines(r) + _kv_lines(r) + _activation_lines(r)


def _moe_groups(r: ModelReport) -> dict[MoESpec, int]:
    groups: dict[MoESpec, int] = defaultdict(int)
    for layer in r.spec.layers:
        if isinstance(layer.ffn, MoESpec):
            groups[layer.ffn] += 1
    return groups


def traffic_section(r: ModelReport) -> list[str]:
    s = r.single
    b, tied = r.counts.breakdown, r.spec.tie_word_embeddings
    lines = [
        "Bytes read per decoded token (one embedding row, not the table)",
        "    dense weights: attention, norms, routers, shared experts, dense MLPs, head",
    ]
    dense = f"{u.n(r.counts.total_params)} − {u.n(b.routed_experts_total)} − {u.n(b.embedding)}"
    if tied:
        lines.append(_line("  total − routed − embedding + tied head", f"{dense} + {u.n(b.embedding)}", s.dense_params))
    else:
        lines.append(_line("  total − routed experts − embedding", dense, s.dense_params))
    lines.append(_line("K routed experts per MoE layer", "", s.expert_params))
    lines.append(_line("one embedding row  D", "", s.embedding_row_params))
    lines.append(_line("parameters read at batch 1", "", s.params_read) + " (= active_params_excl_input_embedding + one row)")
    lines.append(_line("weight bytes", _weight_bytes_formula(r, s), s.weight_bytes))
    lines.append(_line("+ KV cache read at this context", "", s.kv_bytes))
    lines.append(_bytes_line("bytes per token, batch 1", "", s.total_bytes))
    if r.batched.batch > 1:
        lines += _batched_traffic_lines(r)
    return lines


def _weight_bytes_formula(r: ModelReport, t) -> str:
    """params × bits / 8, or (dense + rows) × dense bits / 8 + experts × bits / 8 under an
    expert-only format (mxfp4: the rest bf16)."""
    dt = r.request.dtype
    if not dt.dense:
        return f"{u.n(t.params_read)} × {u.bits(dt.bits)} / 8"
    dense = u.n(t.dense_params + t.embedding_row_params)
    return f"{dense} × {u.bits(dense_dtype(dt).bits)} / 8 + {u.n(t.expert_params)} × {u.bits(dt.bits)} / 8"


def _batched_traffic_lines(r: ModelReport) -> list[str]:
    t = r.batched
    lines = [f"  batch {t.batch}: dense weights once per step, one row per token, the union of chosen experts"]
    for moe, layers in _moe_groups(r).items():
        e, k = moe.num_experts, moe.top_k
        d = expected_distinct_experts(e, k, t.batch)
        lines.append(
            f"    distinct experts per MoE layer, uniform routing: E × (1 − (1 − K/E)^B) = {e} × (1 − (1 − {k}/{e})^{t.batch})"
            f" = {d:.3f} (× {_layers(layers)} × {u.n(moe.expert.params())} params)"
        )
    formula = f"{u.n(t.dense_params)} + {u.n(t.embedding_row_params)} + {u.n(t.expert_params)}"
    lines.append(_line("parameters read per step", formula, t.params_read))
    lines.append(_line("weight bytes per step", _weight_bytes_formula(r, t), t.weight_bytes))
    lines.append(_line("+ KV caches  batch × per sequence", f"{t.batch} × {u.n(r.memory.kv.bytes_per_sequence)}", t.kv_bytes))
    lines.append(
        _bytes_line(f"bytes per step of {t.batch} tokens", "", t.total_bytes)[:-1]
        + f"; {u.nbytes(t.total_bytes / t.batch)} per token)"
    )
    return lines


# -- device -------------------------------------------------------------------------------------


def _bound_lines(b: Bound, bandwidth: float, peak: float) -> list[str]:
    return [
        f"    bandwidth bound  bytes / bandwidth = {u.n(b.bytes)} / {u.n(bandwidth)} = {u.ms(b.t_bandwidth)}",
        f"    compute bound    FLOPs / peak = {u.n(b.flops)} / {u.n(peak)} = {u.ms(b.t_compute)}",
        f"    → {b.binds} binds: at least {u.ms(b.step_seconds)} per step, at most {b.tokens_per_s:,.1f} tokens/s",
    ]


def roofline_section(r: ModelReport) -> list[str]:
    f = r.roofline
    assert f is not None
    many = f.gpus > 1
    lines = [
        f"Roofline on {f'{f.gpus} × ' if many else ''}{f.hardware} ({f.label})",
        f"    bandwidth {u.bandwidth(f.bandwidth)}, peak {f.peak_dtype} {u.rate(f.peak_flops, 'FLOP/s')}"
        + (f" ({f.gpus} devices added up, no communication cost)" if many else ""),
        f"    source: {f.source}",
    ]
    if f.peak_dtype != r.request.dtype.compute:
        lines.append(f"    ({r.request.dtype.name} weights compute at the {f.peak_dtype} rate on this device)")
    formula = f"2 × {u.n(f.params_per_token)} + {u.n(f.attention_flops_per_token)}"
    lines.append(_line("FLOPs per token  2 × params multiplied + attention", formula, f.flops_per_token))
    lines.append("      (attention: 2 × heads × (qk_dim + v_dim) per cached token per layer)")
    lines.append("  batch 1")
    lines += _bound_lines(f.single, f.bandwidth, f.peak_flops)
    if f.batched.batch > 1:
        lines.append(f"  batch {f.batched.batch} (one step decodes {f.batched.batch} tokens)")
        lines += _bound_lines(f.batched, f.bandwidth, f.peak_flops)
    per_device = f.capacity_bytes // f.gpus
    verdict = "fits" if f.fits else f"does NOT fit (needs {-(-f.memory_bytes // per_device)} devices)"
    lines.append(
        f"    memory: needs {u.nbytes(f.memory_bytes)} of {u.nbytes(f.capacity_bytes)}"
        f" ({u.nbytes(f.per_gpu_bytes)} per device) → {verdict}"
    )
    return lines


def sla_section(r: ModelReport) -> list[str]:
    s, f, dt, one = r.sla, r.roofline, r.request.dtype, r.single
    assert s is not None and f is not None
    budget = s.budget_ms / 1000
    by_bw, by_c = params_within(budget, f, dt, one)
    return [
        f"Latency budget {s.budget_ms:g} ms per token at batch 1: how many parameters may a token touch?",
        "    bandwidth allows (budget × bandwidth − KV bytes) × 8 / bits − one row",
        f"      = ({budget:g} × {u.n(f.bandwidth)} − {u.n(one.kv_bytes)}) × 8 / {u.bits(dt.bits)}"
        f" − {u.n(one.embedding_row_params)} = {u.n(by_bw)}",
        "    compute allows (budget × peak − attention FLOPs) / 2",
        f"      = ({budget:g} × {u.n(f.peak_flops)} − {u.n(f.attention_flops_per_token)}) / 2 = {u.n(by_c)}",
        f"    → at most {u.n(s.max_params)} ({u.params(s.max_params)}) parameters per token ({s.binds} binds)"
        f" = {u.pct(s.max_share)} of this model's {u.params(r.counts.total_params)}",
        f"    this model touches {u.params(s.model_params)} ({u.pct(s.model_share)}) and needs {s.model_ms:,.3f} ms:"
        f" it {_verdict(s)}",
    ] + ([] if s.fits_memory else [f"    it does NOT fit: {not_fitting(r, s)}"]) + _sla_beyond(r)


def _verdict(s) -> str:
    if s.fits_memory:
        return f"{'meets' if s.meets else 'misses'} the budget"
    return f"{'would meet' if s.model_ms <= s.budget_ms else 'would miss'} the budget if it fit in memory"


def _sla_beyond(r: ModelReport) -> list[str]:
    """What a budget the whole model fits in still answers: headroom and the batch it serves."""
    s = r.sla
    assert s is not None
    lines = []
    if s.whole_model_fits:
        lines.append(
            f"    the whole model ({u.params(r.counts.total_params)}) fits the budget: no routing can use"
            f" {u.pct(s.max_share)} of it; {s.headroom:,.1f}× headroom at batch 1"
        )
    if s.max_batch:
        binds = "the budget" if s.max_batch_binds == "latency" else "the devices' memory"
        lines.append(
            f"    largest batch decoded within {s.budget_ms:g} ms per step at context {u.n(r.request.context)}:"
            f" {s.max_batch:,} sequences ({binds} stops the next)"
        )
    return lines


# -- claims -------------------------------------------------------------------------------------


def claims_section(r: ModelReport, claims: Claims) -> list[str]:
    c = r.counts
    lines = ['The published claim, tested (from this config\'s "_claims")', f"    source: {claims.source}"]
    if claims.total_params and claims.active_params:
        lines.append(
            f"    claimed: ~{u.params(claims.total_params)} total, ~{u.params(claims.active_params)} per token"
            f" → {u.pct(claims.active_params / claims.total_params)} active"
        )
    lines.append(
        f"    this config: {u.params(c.active_params)} of {u.params(c.total_params)} → {u.pct(c.active_fraction)} active"
        f" ({u.pct(c.active_params_non_embedding / c.total_params)} without embedding and head)"
    )
    target = claims.slogan_active_share
    if target is None:
        return lines
    said = f'the slogan "{claims.slogan}"' if claims.slogan else "the claimed share"
    if abs(c.active_fraction - target) <= 0.1 * target:
        lines.append(f"    {said} says {u.pct(target)}: these figures agree ({u.pct(c.active_fraction)}).")
        return lines
    lines.append(f"    {said} says {u.pct(target)}: these figures imply {u.pct(c.active_fraction)}, not {u.pct(target)}.")
    analysis = share_analysis(r.spec, c, target)
    return lines + (_share_lines(analysis) if analysis is not None else [])


def _share_lines(a: ShareAnalysis) -> list[str]:
    t, e, k = u.pct(a.target), a.expert_all_layers, a.top_k
    above = f", above {t} already" if a.routing_floor > a.target else ""
    k1 = (a.always_on + e) / (a.always_on + a.num_experts * e)
    lines = [
        f"    What would make it {t}? With A = always-on {u.params(a.always_on)}, e = one expert over all layers"
        f" {u.params(e)}, share = (A + K·e) / (A + E·e):",
        f"    - routing sets a floor: K / E = {k} / {a.num_experts} = {u.pct(a.routing_floor)}"
        f" of the experts run per token{above}.",
        f"    - more experts, same K = {k}, same e and A: E = ((A + K·e) / {a.target:g} − A) / e"
        f" = (({u.n(a.always_on)} + {k} × {u.n(e)}) / {a.target:g} − {u.n(a.always_on)}) / {u.n(e)}"
        f" = {a.experts_needed:,.1f} experts per layer (total {u.params(a.total_if_experts_needed)}).",
        f"    - fewer experts per token: K = 1 gives (A + e) / (A + E·e) = {u.pct(k1)}.",
    ]
    budget = u.params(a.budget_at_same_total)
    same_total = (
        f"    - same total: {t} of {u.params(a.total)} is {budget} per token, but the always-on part"
        f" alone is {u.params(a.always_on)} = {u.pct(a.always_on_share)} of the total (attention alone"
        f" {u.params(a.attention)} = {u.pct(a.attention_share)})"
    )
    if a.always_on >= a.budget_at_same_total:
        same_total += f": impossible without shrinking attention and the other always-on weights below {budget}."
    else:
        room = (a.budget_at_same_total - a.always_on) / k
        same_total += f": the K experts would have to shrink to {u.params(room)} each over all layers (now {u.params(e)})."
    return lines + [same_total]


def explain(r: ModelReport, claims: Optional[Claims] = None) -> str:
    f = model_formula(r.spec)
    req = r.request
    head = [
        f"{r.spec.name} (model_type {r.spec.model_type}): how the numbers are computed",
        f"  D = hidden {u.n(r.spec.hidden_size)}, V = vocab {u.n(r.spec.vocab_size)}, L = {r.spec.num_layers} layers,"
        f" E routed experts, K experts per token, F expert width; dtype {req.dtype.name},"
        f" context {u.n(req.context)}, batch {req.batch}",
    ]
    sections = [layer_section(f), model_section(r, f), active_section(r, f), memory_section(r), traffic_section(r)]
    if r.roofline is not None:
        sections.append(roofline_section(r))
    if r.sla is not None:
        sections.append(sla_section(r))
    if claims is not None:
        sections.append(claims_section(r, claims))
    numbered = [[f"{i}. {s[0]}", *s[1:]] for i, s in enumerate(sections, start=1)]
    return "\n\n".join("\n".join(s) for s in [head, *numbered]) + "\n"
