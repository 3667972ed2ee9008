"""The caller's side: the gRPC client, the reference scheduler and its allocator, and the CLI."""
