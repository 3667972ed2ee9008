"""The KV data plane: a request's K/V bytes exported from, and imported into, the slot pool."""
