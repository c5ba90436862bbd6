"""What replica and router share: auth, gRPC helpers, flags, tracing, metrics endpoint."""
