"""`moekit serve`: an OpenAI-compatible HTTP server over the engine's continuous-batching scheduler.

The web layer knows no tensors: it validates requests (errors in OpenAI's shape), turns text into
token ids and back, and hands `moekit.engine.scheduler.Request`s to the scheduler's thread.
"""
