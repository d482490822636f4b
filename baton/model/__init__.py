"""Model definitions shared by prefill and decode."""
