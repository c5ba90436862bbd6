"""One replica: the grpc.aio servicer over an engine, its config, metrics and `deja serve`."""
