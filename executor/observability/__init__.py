"""Metrics, traces and logs: the adapters that turn the engine's stats and observer events into telemetry."""
