"""One path per `Route`: its local stages, its collective, its state (base.py: what they share)."""
