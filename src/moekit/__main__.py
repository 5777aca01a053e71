"""`python -m moekit ...` (and `torchrun -m moekit ...`): the same CLI as the `moekit` command."""

from moekit.cli import main

main()
