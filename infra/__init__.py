"""Infrastructure as code and its offline checks (scripts/check_infra.sh runs them)."""
