"""`moekit eval-routing`: what each routing policy costs and saves, on held-out text.

Per policy and domain, teacher-forced over windows of the domain's held-out stream (documents +
eos, the first `max_tokens`), each window scored from its own start as `moekit eval` does:
  bits per byte   Σ −log2 p(next token) / bytes of the scored tokens (byte-level BPE: exact bytes)
  Δ bits per byte against exact routing on the same tokens
  experts/token   distinct routed experts per token, mean over MoE layers
  active share    the meter's share (embedding and head in full), mean over tokens
  next-token agreement  share of positions whose greedy next token equals exact routing's
and, free-running, `generated agreement`: greedy continuations of `agree_tokens` tokens from the
first `agree_prompts` held-out documents, the share of tokens before the first one that differs
from exact routing's continuation.

A batch's windows run side by side, so each position of the batch is what one decode step of
`batch` rows would route together (a "step"). Per step and MoE layer:
  experts/step    distinct experts with a non-zero weight: the expert weights a batched step reads
  step overflow   assignments beyond capacity 1.0 (max(1, ceil(B·K/E)) per expert), over all assignments
  paged hit rate  the steps replayed, layer by layer, through the store's cache (LRU; by
                  moekit.analysis.replay, which counts as SlotCache does) with a quarter of the
                  experts' slots: what --expert-memory at 25% would hit without prefetch
and the policy's own counters (moekit.model.routing.PolicyStats): cache hits, overflow, dropped, rerouted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from moekit.errors import MoekitError


@dataclass
class PolicyScore:
    tokens: int = 0
    bytes: int = 0
    nll_bits: float = 0.0
    experts: float = 0.0  # Σ over tokens of distinct experts per MoE layer (mean over layers)
    share: float = 0.0  # Σ over tokens of active share
    agree: int = 0  # positions whose argmax equals exact's
    generated: list[float] = field(default_factory=list)  # per prompt: share before the first difference
    steps: int = 0  # (step, MoE layer) pairs
    step_experts: int = 0  # Σ distinct experts read per (step, layer)
    step_assignments: int = 0
    step_overflow: int = 0  # Σ assignments beyond capacity 1.0
    paged_hits: int = 0
    paged_accesses: int = 0
    counters: dict = field(default_factory=dict)  # PolicyStats' fields, added over batches

    def as_dict(self, exact: Optional["PolicyScore"]) -> dict:
        bpb = self.nll_bits / self.bytes if self.bytes else None
        base = exact.nll_bits / exact.bytes if exact is not None and exact.bytes else None
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "bits_per_byte": bpb,
            "delta_bits_per_byte": None if bpb is None or base is None else bpb - base,
            "experts_per_token": self.experts / self.tokens if self.tokens else None,
            "active_share": self.share / self.tokens if self.tokens else None,
            "next_token_agreement": self.agree / self.tokens if self.tokens else None,
            "generated_agreement": sum(self.generated) / len(self.generated) if self.generated else None,
            "experts_per_step": self.step_experts / self.steps if self.steps else None,
            "step_overflow": self.step_overflow / self.step_assignments if self.step_assignments else None,
            "paged_hit_rate": self.paged_hits / self.paged_accesses if self.paged_accesses else None,
            "cache_hit_rate": (self.counters["cache_hits"] / self.counters["cache_lookups"]
                               if self.counters.get("cache_lookups") else None),
            "counters": dict(self.counters),
        }

    def add(self, other: "PolicyScore") -> None:
        """Pool `other` into this score (domains into all)."""
        for name in ("tokens", "bytes", "nll_bits", "experts", "share", "agree", "steps", "step_experts",
                     "step_assignments", "step_overflow", "paged_hits", "paged_accesses"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.generated += other.generated
        add_counters(self.counters, other.counters)


def add_counters(into: dict, counters: dict) -> None:
    for name, value in counters.items():
        into[name] = into.get(name, 0) + value


def step_loads(decisions: list, rows: int, valid, experts: int, cap_k: int) -> dict:
    """Per MoE layer, per step (position) of the batch: the sorted distinct experts its real tokens
    read at a non-zero weight, and the assignments beyond capacity 1.0 → {layer: (steps, overflow, assignments)}."""
    from moekit.model.routing_policies import capacity_of

    out = {}
    cap = capacity_of(1.0, rows, cap_k, experts)
    for layer, d in decisions:
        ids = d.topk_ids.cpu().view(rows, -1, d.topk_ids.shape[1])  # [B, W, K]
        used = (d.topk_weights.cpu() != 0).view_as(ids) & valid[:, :, None]  # [B, W, K]
        steps, overflow, assignments = [], 0, 0
        for t in range(ids.shape[1]):
            chosen = ids[:, t][used[:, t]]
            if chosen.numel() == 0:
                continue
            load = torch.bincount(chosen, minlength=experts)
            overflow += int((load - cap).clamp_min(0).sum())
            assignments += int(chosen.numel())
            steps.append(tuple(int(e) for e in load.nonzero().flatten()))
        out[layer] = (steps, overflow, assignments)
    return out


def token_bytes(tokenizer, vocab: int) -> torch.Tensor:
    """[V] UTF-8 bytes of each token's text: byte-level BPE pieces are one character per byte;
    special tokens (eos, pad) have none."""
    special = set(tokenizer.get_added_tokens_decoder())
    out = torch.zeros(vocab, dtype=torch.int64)
    for i in range(vocab):
        piece = tokenizer.id_to_token(i)
        if piece is not None and i not in special:
            out[i] = len(piece)
    return out


def _windows(stream: list[int], window: int) -> list[list[int]]:
    return [stream[i : i + window] for i in range(0, len(stream) - 1, window) if len(stream[i : i + window]) >= 2]


def _score_batch(decoder, group: list[list[int]], policy):
    """One right-padded batch → (logits [B, W, V], valid [B, W], ids [B, W], experts [B*W, L] per layer,
    the decisions, the run's counters)."""
    from moekit.model.routing import PolicyRun

    # Right padding: pads follow every real token, so neither attention nor a policy's state
    # (which runs forward along each row) lets them touch a real one.
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(c, dtype=torch.int64) for c in group], batch_first=True)
    rows, width = ids.shape  # [B, W]
    valid = torch.arange(width)[None, :] < torch.tensor([len(c) for c in group])[:, None]  # [B, W]
    decisions: list = []
    run = PolicyRun(policy, rows)
    with torch.inference_mode():
        positions = torch.arange(width, device=decoder.device)[None].expand(rows, width)
        logits = decoder(ids.to(decoder.device), decoder.new_cache(rows, width), positions, decisions, policy=run)
    experts = {}
    for layer, d in decisions:
        chosen = d.topk_ids.cpu()
        repeat = torch.zeros_like(chosen, dtype=torch.bool)
        for j in range(1, chosen.shape[1]):
            repeat[:, j] = (chosen[:, :j] == chosen[:, j : j + 1]).any(dim=1)
        experts[layer] = ((~repeat) & (d.topk_weights.cpu() != 0)).sum(dim=1).clamp_min(1)  # [B*W] distinct experts
    return logits.float().cpu(), valid, ids, experts, decisions, vars(run.stats)


def score_policies(engine, streams: dict[str, list[int]], policies: list, window: int = 256, batch: int = 8,
                   progress=lambda text: None) -> dict[str, dict[str, PolicyScore]]:
    """domain → str(policy) → PolicyScore; policies[0] must be exact (the reference)."""
    from moekit.analysis.replay import Replay
    from moekit.engine.meter import params_per_token

    params = params_per_token(engine.spec)
    experts_e, k = model_experts(engine.spec), model_k(engine.spec)
    nbytes = token_bytes(engine.tokenizer, engine.spec.vocab_size)
    out: dict[str, dict[str, PolicyScore]] = {}
    for domain, stream in streams.items():
        chunks = _windows(stream, window)
        scores = {str(p): PolicyScore() for p in policies}
        # one paged store per policy and layer, warm across the domain's batches
        paged = {str(p): {} for p in policies}
        for begin in range(0, len(chunks), batch):
            group = chunks[begin : begin + batch]
            exact_top = None
            for policy in policies:
                progress(f"{domain}: {policy} ({min(begin + batch, len(chunks))}/{len(chunks)} windows)")
                logits, valid, ids, experts, decisions, counters = _score_batch(engine.decoder, group, policy)
                target_ok = valid[:, 1:]
                logp = torch.log_softmax(logits[:, :-1], dim=-1)
                nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
                top = logits[:, :-1].argmax(dim=-1)
                exact_top = top if exact_top is None else exact_top
                s = scores[str(policy)]
                s.tokens += int(target_ok.sum())
                s.bytes += int(nbytes[ids[:, 1:][target_ok]].sum())
                s.nll_bits += float(nll[target_ok].sum()) / math.log(2)
                s.agree += int((top == exact_top)[target_ok].sum())
                # the routing that produced each scored prediction: positions 0..W-2 of each row
                per_layer = torch.stack([experts[l].view(len(group), -1) for l in sorted(experts)])  # [L, B, W]
                used = per_layer[:, :, :-1][:, target_ok]  # [L, n]
                s.experts += float(used.float().mean(dim=0).sum())
                active = params.active({}) + sum(params.expert_each[l] * used[i].double()
                                                 for i, l in enumerate(sorted(experts)))
                s.share += float((active / params.total_params).sum())
                add_counters(s.counters, counters)
                for layer, (steps, overflow, assignments) in step_loads(decisions, len(group), valid, experts_e, k).items():
                    cache = paged[str(policy)].setdefault(layer, Replay(max(1, experts_e // 4), "lru"))
                    before = cache.hits, cache.misses
                    cache.run(steps)
                    s.paged_hits += cache.hits - before[0]
                    s.paged_accesses += cache.hits + cache.misses - before[0] - before[1]
                    s.steps += len(steps)
                    s.step_experts += sum(len(x) for x in steps)
                    s.step_overflow += overflow
                    s.step_assignments += assignments
        out[domain] = scores
    return out


def agreement(engine, prompts: dict[str, list[list[int]]], policies: list, new_tokens: int,
              scores: dict[str, dict[str, PolicyScore]], progress=lambda text: None) -> None:
    """Greedy continuations under each policy against exact routing's; adds to scores[domain][policy]."""
    for domain, firsts in prompts.items():
        for ids in firsts:
            reference = None
            for policy in policies:
                progress(f"{domain}: generating under {policy}")
                gen = engine.generate(ids, max_new_tokens=new_tokens, stop_ids=(), record_routing=False,
                                      policy=policy)
                got = gen.token_ids[0]
                reference = got if reference is None else reference
                same = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), len(reference))
                scores[domain][str(policy)].generated.append(same / len(reference))


def held_out_streams(engine, corpus: Path, max_tokens: int) -> dict[str, list[int]]:
    from moekit.corpus.reader import read_split
    from moekit.train.data import tokenize_domains

    if engine.tokenizer is None:
        raise MoekitError(f"{engine.folder}: no tokenizer.json; eval-routing scores text and needs the tokenizer")
    streams = tokenize_domains(engine.tokenizer, read_split(corpus, "heldout"))
    return {d: s[:max_tokens].tolist() for d, s in streams.items()}


def summary(scores: dict[str, dict[str, PolicyScore]], policies: list) -> dict:
    """Per policy: all domains pooled and each domain; the JSON of `moekit eval-routing --json`."""
    names = [str(p) for p in policies]
    pooled = {}
    for name in names:
        total = PolicyScore()
        for per in scores.values():
            total.add(per[name])
        pooled[name] = total
    return {
        "policies": names,
        "all": {n: pooled[n].as_dict(pooled[names[0]]) for n in names},
        "domains": {d: {n: per[n].as_dict(per[names[0]]) for n in names} for d, per in scores.items()},
    }


def model_k(spec) -> int:
    """The model's K (the most experts per token of any MoE layer)."""
    ks = [spec.layers[l].ffn.top_k for l in spec.moe_layers]
    if not ks:
        raise MoekitError(f"{spec.name}: the model has no MoE layers, so there is no routing to change")
    return max(ks)


def model_experts(spec) -> int:
    """The model's E (the fewest routed experts of any MoE layer: what a policy may widen to)."""
    return min(spec.layers[l].ffn.num_experts for l in spec.moe_layers)


def parse_policies(text: str, k: int, num_experts: Optional[int] = None) -> list:
    """'top2,top1,adaptive:0.85' → [Exact(), TopK(2), TopK(1), Adaptive(0.85)]: exact routing first
    (every policy is measured against it), duplicates dropped."""
    from moekit.model.routing import Exact, parse_policy

    parts = [p for p in (t.strip() for t in text.split(",")) if p]
    if not parts:
        raise MoekitError(f"--policies {text!r}: name at least one policy (e.g. topk:1,adaptive:0.85)")
    policies = [Exact()] + [parse_policy(p, k, num_experts) for p in parts]
    return list(dict.fromkeys(policies))


def evaluate_policies(engine, corpus: Path, policies: list, max_tokens: int, window: int, agree_prompts: int,
                      agree_tokens: int, progress=lambda text: None, batch: int = 8) -> dict:
    """The whole of `moekit eval-routing`: scores, agreement, and the JSON-ready summary."""
    streams = held_out_streams(engine, corpus, max_tokens)
    scores = score_policies(engine, streams, policies, window=window, batch=batch, progress=progress)
    if agree_prompts > 0 and agree_tokens > 0:
        from moekit.corpus.reader import read_split

        held = read_split(corpus, "heldout")
        firsts = {d: [engine.encode(t)[:window] or [0] for t in docs[:agree_prompts]] for d, docs in held.items()}
        agreement(engine, firsts, policies, agree_tokens, scores, progress=progress)
    out = summary(scores, policies)
    out.update({"corpus": str(corpus), "window": window, "batch": batch, "max_tokens_per_domain": max_tokens,
                "agree_prompts": agree_prompts, "agree_tokens": agree_tokens})
    return out
