"""Held-out evaluation of a checkpoint on a corpus: perplexity per domain against a unigram baseline,
and which experts each domain uses.

The model runs through the engine (moekit.engine.loader.load_engine): what is measured is what
`moekit run` will generate with. Each held-out document (+ eos) is cut into windows of `window`
tokens scored independently (the first token of a window has no context, as in training).

Expert usage: per domain and layer, the share of the chosen (token, expert) assignments each expert
got. Divergence between two domains: Jensen–Shannon (base 2, so 0 = same usage, 1 = disjoint) of
those distributions, averaged over layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from moekit.errors import MoekitError


@dataclass
class DomainResult:
    tokens: int
    loss: float  # nats per token
    unigram_loss: float
    usage: list[list[float]]  # [L_moe][E] share of assignments

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def unigram_perplexity(self) -> float:
        return math.exp(self.unigram_loss)


@dataclass
class EvalResult:
    domains: dict[str, DomainResult]
    divergence: dict[str, dict[str, float]] = field(default_factory=dict)  # JS, averaged over layers
    moe_layers: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "domains": {
                d: {
                    "tokens": r.tokens,
                    "loss": r.loss,
                    "perplexity": r.perplexity,
                    "unigram_loss": r.unigram_loss,
                    "unigram_perplexity": r.unigram_perplexity,
                    "expert_usage": r.usage,
                }
                for d, r in self.domains.items()
            },
            "moe_layers": self.moe_layers,
            "js_divergence": self.divergence,
        }


def unigram_log_probs(streams: list[Tensor], vocab: int) -> Tensor:
    """[V] log p(token) fit on training tokens, add-one smoothed (so unseen held-out tokens stay finite)."""
    counts = torch.ones(vocab, dtype=torch.float64)
    for s in streams:
        counts += torch.bincount(s.long(), minlength=vocab)[:vocab].double()
    return (counts / counts.sum()).log()


def js_divergence(p: Tensor, q: Tensor) -> float:
    """Jensen–Shannon divergence in bits between two distributions over the same experts."""
    p, q = p.double() / p.sum(), q.double() / q.sum()
    m = 0.5 * (p + q)

    def kl(a: Tensor, b: Tensor) -> float:
        nz = a > 0
        return float((a[nz] * (a[nz] / b[nz]).log2()).sum())

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) >= 2]


def score_windows(decoder, chunks: list[list[int]], num_experts: int, moe_layers: list[int], batch: int, top_k=None):
    """(Σ nll, tokens scored, counts [L_moe, E]) over chunks, each scored from its own start.

    top_k: experts per token (an expert-budget tier); None for the model's own K."""
    total, scored = 0.0, 0
    counts = torch.zeros(len(moe_layers), num_experts, dtype=torch.float64)
    row_of = {layer: i for i, layer in enumerate(moe_layers)}
    device = decoder.device
    for begin in range(0, len(chunks), batch):
        group = chunks[begin : begin + batch]
        width = max(len(c) for c in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        valid = torch.zeros(len(group), width, dtype=torch.bool)
        for r, c in enumerate(group):
            ids[r, : len(c)] = torch.tensor(c)
            valid[r, : len(c)] = True
        # Right padding: pad keys sit after every real query, so causal masking already hides them.
        cache = decoder.new_cache(len(group), width)
        positions = torch.arange(width)[None].expand(len(group), width)
        decisions: list = []
        with torch.inference_mode():
            per_token = None if top_k is None else [top_k] * ids.numel()
            logits = decoder(ids.to(device), cache, positions.to(device), decisions, top_k=per_token)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).cpu()
        target_ok = valid[:, 1:]
        nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
        total += float(nll[target_ok].sum())
        scored += int(target_ok.sum())
        for layer, decision in decisions:
            chosen = decision.topk_ids.cpu().view(len(group), width, -1)[valid][:, : top_k or None]  # real tokens only
            counts[row_of[layer]] += torch.bincount(chosen.reshape(-1), minlength=num_experts).double()
    return total, scored, counts


def evaluate(
    checkpoint: Path,
    corpus: Path,
    window: int = 256,
    max_tokens: int = 50_000,
    batch: int = 8,
    device: str = "cpu",
    progress=lambda domain: None,
    verify: bool = True,
) -> EvalResult:
    """Score every domain's held-out split (its first `max_tokens` tokens, in document order).
    verify: check the weights against moekit-experts.json as they load (load_engine's)."""
    from moekit.corpus.reader import read_split
    from moekit.engine.loader import load_engine
    from moekit.model.moe import MoE
    from moekit.train.data import tokenize_domains

    engine = load_engine(checkpoint, dtype="float32", device=device, verify=verify, compile=False)  # scores by forward
    if engine.tokenizer is None:
        raise MoekitError(f"{checkpoint}: no tokenizer.json; eval needs the model's tokenizer")
    decoder, vocab = engine.decoder, engine.spec.vocab_size
    moe_layers = [i for i, b in enumerate(decoder.layers) if isinstance(b.ffn, MoE)]
    if not moe_layers:
        raise MoekitError(f"{checkpoint}: the model has no MoE layers")
    num_experts = decoder.layers[moe_layers[0]].ffn.experts.num_experts
    unigram = unigram_log_probs(list(tokenize_domains(engine.tokenizer, read_split(corpus, "train")).values()), vocab)
    held = tokenize_domains(engine.tokenizer, read_split(corpus, "heldout"))
    results: dict[str, DomainResult] = {}
    for domain, stream in held.items():
        progress(domain)
        ids = stream[:max_tokens].tolist()
        chunks = windows(ids, window)
        nll, scored, counts = score_windows(decoder, chunks, num_experts, moe_layers, batch)
        targets = torch.tensor([t for c in chunks for t in c[1:]], dtype=torch.int64)
        uni = float(-unigram[targets].sum()) / max(1, len(targets))
        usage = (counts / counts.sum(dim=1, keepdim=True).clamp_min(1)).tolist()
        results[domain] = DomainResult(tokens=scored, loss=nll / max(1, scored), unigram_loss=uni, usage=usage)
    names = list(results)
    divergence = {
        a: {
            b: sum(js_divergence(torch.tensor(results[a].usage[l]), torch.tensor(results[b].usage[l]))
                   for l in range(len(moe_layers))) / len(moe_layers)
            for b in names
        }
        for a in names
    }
    return EvalResult(domains=results, divergence=divergence, moe_layers=moe_layers)


def resolve_checkpoint(target: Path) -> Path:
    """A checkpoint folder (config.json inside), or a run folder whose model/ is one."""
    target = Path(target)
    if (target / "config.json").is_file():
        return target
    if (target / "model" / "config.json").is_file():
        return target / "model"
    raise MoekitError(f"{target}: neither a checkpoint (config.json) nor a run folder with model/config.json")
