"""The store subsystem: the sole writer of durable state (SQLite under the state dir)."""
