"""Local deja processes (replicas, routers) started, waited for, scraped and stopped: what the
integration tests and the benchmarks run their clusters with."""
