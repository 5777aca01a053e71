"""How a model COMPUTES: native PyTorch decoders for the MoE (and dense) families, exact against
transformers.

    from moekit.model.decoder import Decoder
    decoder = Decoder(spec, dtype=torch.bfloat16)          # spec: moekit.spec.load_spec(folder)
    decoder.load_checkpoint(open_checkpoint(folder))        # Hub names, every tensor checked; then
                                                           # weights re-laid out for fast kernels
    cache = decoder.new_cache(batch, max_len)              # preallocated; mark left pads in key_mask
    logits = decoder(input_ids, cache, positions, decisions=[])

Modules: norms, rope, attention (MHA/GQA) and mla (DeepSeek), routing, experts (and expert_forms:
how a layer's experts are held and run), mlp, moe, decoder (decode_step: the T = 1 step, compiled
by compiled_step or run eagerly), combinations (which options combine, refused in one line),
cache, linear (projection kernels: one weight layout per device and dtype), hub_names (where each
family keeps its tensors) and loading (Hub tensors → parameters).
Importing this package does not import torch; its modules do.
"""
