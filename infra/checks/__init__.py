"""Offline checks of the infrastructure templates (run by scripts/check_infra.sh)."""
