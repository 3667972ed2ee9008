"""Future-token references for overlap scheduling: the executor's future table."""

from executor.future_tokens.table import FutureChange, FutureTokenTable, future_references

__all__ = ["FutureChange", "FutureTokenTable", "future_references"]
