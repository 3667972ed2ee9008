"""The engine's vocabulary, floor 1: the batch and its field table, the wire and metric names,
the step's outputs, limits, buckets, toggles and errors. It imports nothing from the
executor above it (`ops` and `registry` only), so every other package may use it."""
