"""The gRPC service around the engine: server, handlers, wire codec, device worker, auth, settings."""
