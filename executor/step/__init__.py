"""The step, the engine's roof: one batch from admission to sampled tokens.

`step.py` runs a batch (`Step`: admit, stage, launch, read); `graph_control.py` is the
runtime toggles' one writer. The step's vocabulary (`StepBatch`, the feature protocol, its
clock and outputs) is in `executor.core`.
"""
