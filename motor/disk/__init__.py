"""The disk subsystem: free-space admission (eviction, size cache and retention of
workspaces deepen it in later work)."""
