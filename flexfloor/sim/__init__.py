"""Cluster-scale simulator of a rollout: static EP vs FlexFloor on N accelerators.

It drives the real policy objects (the `Scheduler`, its `LengthHistory` and `Predictor`, the
release decision of `flexfloor.rollout.release` with `plan_shrink` and the memory floor) over a
discrete-event model of the engine's lockstep steps, priced by a roofline cost model of published
accelerator figures. `tools/simulate.py` is the command; see flexfloor/sim/scenarios.py.
"""
