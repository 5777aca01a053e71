"""The tiered expert store: routed experts paged between disk and memory under a byte budget.

Dense weights stay resident; each MoE layer keeps at most `slots` experts in memory, chosen by a
pluggable policy, loaded from the checkpoint's safetensors (or a packed file) and checked against
a manifest of checksums. `spec`-level pieces (budget, policies, slot cache, cache-sim) import
without torch.
"""
