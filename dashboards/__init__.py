"""fp8guard.dashboards: Grafana dashboards, Prometheus rules and web-dashboard assets (to come)."""
