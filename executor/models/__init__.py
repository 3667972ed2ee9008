"""Model code and loaders: decoder families (`registry.py`) over our KV cache and backends.

Import from the submodules (`executor.models.loader`, `executor.models.llama`, ...); this
package re-exports nothing, so that `executor.config` can use `executor.models.config`
without importing the loaders.
"""
