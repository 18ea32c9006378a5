"""The accounting subsystem: refusal counts and the health report's figures."""
