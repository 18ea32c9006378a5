"""Memory admission and per-job limits: the jobs slice and the declared capacity."""
