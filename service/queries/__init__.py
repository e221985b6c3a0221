"""Queries: the read side (run lists and details, downsampled series, the closed loop's records,
Prometheus metrics) that dashboards, Grafana and curl use."""
