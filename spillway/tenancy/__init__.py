"""Tenants: who is calling (``identity``) and where their data may live (``areas``)."""
