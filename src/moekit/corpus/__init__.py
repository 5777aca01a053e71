"""The demo model's corpus: text from Debian packages and the Python standard library, by domain.

sources.py finds raw documents per domain; roff.py turns man pages into plain text; clean.py
normalises, filters, deduplicates and splits; build.py writes data/corpus; reader.py reads it back.
"""
