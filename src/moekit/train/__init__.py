"""`moekit train` / `moekit eval`: a fine-grained MoE trained from scratch with the engine's own modules.

config.py (TOML → TrainConfig + the Hub config.json), tokenizer.py (byte-level BPE), data.py (token
streams and seeded batches), init.py (a Decoder with transformers' initialisation), forward.py (the
training forward: causal attention, capacity-limited expert dispatch), aux_losses.py (load balance,
z-loss, entropy), hub_save.py (the Hub's format), state.py (checkpoints), loop.py, evaluate.py.
"""
