"""The Lambda functions: thin adapters over the shared core."""
