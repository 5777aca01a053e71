"""Every measurement harness and named baseline, in one place: `moekit bench decode|offload`.

- decode.py: batch decode tok/s of moekit against a baseline, in one run, with the roofline share;
- offload.py + offload_worker.py: decode under expert-memory budgets, one child process per run;
- transformers_baseline.py, accelerate_baseline.py, llama_cpp.py: the named baselines;
- child.py: the child-process JSON protocol the workers and baselines share.

The product's packages (engine/, offload/, model/, serve/, ...) never import this package; it
imports them to measure them. Baseline libraries (transformers, accelerate, llama-cpp-python) are
imported lazily, inside the functions or child processes that need them.
"""
