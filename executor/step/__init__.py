"""The step and its controls: one batch from admission to sampled tokens.

`step.py` runs a batch (`Step.forward`); `clock.py` times its phases once; `outputs.py`
holds what a step and the executor report; `paths.py` the vocabulary of paths and toggles;
`toggles.py` the runtime toggles' one home and `graph_control.py` their one writer.
"""
