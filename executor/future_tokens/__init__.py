"""Future-token references for overlap scheduling: the executor's future table."""

from executor.future_tokens.feature import FutureTokens
from executor.future_tokens.table import FutureChange, FutureTokenTable

__all__ = ["FutureChange", "FutureTokenTable", "FutureTokens"]
