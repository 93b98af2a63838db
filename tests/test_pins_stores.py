"""Pins for the stores: the file store, SQLite and PostgreSQL.

Each test fails when the rule it names is dropped (docs/mutation.md).
"""
