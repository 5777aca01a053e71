"""Expert parallelism: routed experts sharded over torch.distributed ranks, a placement planner and a
cluster simulator.

  placement.py  which logical expert lives on which rank (linear, or a plan file), replica choice
  eplb.py       the planner: hierarchical load balancing after DeepSeek's EPLB (three pure functions)
  exchange.py   the dispatch arithmetic shared by the runtime and the simulator (pure, numpy)
  layer.py      the EP MoE layer a RoutedExperts calls: counts → rows → local experts → rows back
  group.py      process groups: torchrun's env, or ranks this process launches itself; timeouts
  session.py    `moekit run --expert-parallel`: load, check the ranks agree, generate, tear down
  serving.py    `moekit serve --expert-parallel`: rank 0 orders each MoE layer, the others follow
  simulate.py   replay a trace through a placement at 8-256 ranks without the model (no torch)

placement, eplb, exchange and simulate import numpy only, so `moekit placement` and `moekit
simulate` start without torch.
"""
