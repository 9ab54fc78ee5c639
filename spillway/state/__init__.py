"""Shared state: the router's DynamoDB table (``table``) and tenants' quotas in it
(``quotas``)."""
