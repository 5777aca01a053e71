"""`moekit profile`: run a workload's prompts and count which experts each layer used.

The counts cover every real token (prompt and generated) of every prompt: what had to be resident.
The profile's pins are each layer's most used experts; `moekit run --pin` loads them at start and
never evicts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from moekit.engine.generate import token_routing
from moekit.errors import MoekitError
from moekit.offload.pins import model_identity, profile_document


def read_prompts(path: Path) -> list[str]:
    """One prompt per line; blank lines are skipped; `\\n` inside a line stands for a newline."""
    path = Path(path)
    if not path.is_file():
        raise MoekitError(f"{path}: no such prompts file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise MoekitError(f"{path}: not UTF-8 text (one prompt per line)") from None
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise MoekitError(f"{path}: no prompts (one per line)")
    return prompts


def count_experts(engine, prompts: list[str], max_new_tokens: int,
                  on_prompt: Optional[Callable[[int], None]] = None) -> tuple[dict[int, list[int]], int]:
    """layer → uses per expert over all real tokens; and the number of tokens counted."""
    layers = [i for i, layer in enumerate(engine.spec.layers) if layer.is_moe]
    width = engine.spec.layers[layers[0]].ffn.num_experts
    counts = {l: [0] * width for l in layers}
    tokens = set()
    for n, prompt in enumerate(prompts):
        gen = engine.generate(prompt, max_new_tokens=max_new_tokens, record_routing=True)
        for ev in token_routing(gen):
            tokens.add((n, ev.step, ev.position))
            for e in ev.expert_ids:
                counts[ev.layer][e] += 1
        if on_prompt is not None:
            on_prompt(n + 1)
    return counts, len(tokens)


def build_profile(engine, prompts: list[str], max_new_tokens: int, top: int, on_prompt=None) -> dict:
    counts, tokens = count_experts(engine, prompts, max_new_tokens, on_prompt)
    workload = {"prompts": len(prompts), "tokens": tokens, "max_new_tokens": max_new_tokens}
    return profile_document(model_identity(engine.folder, engine.spec), counts, top, workload)
