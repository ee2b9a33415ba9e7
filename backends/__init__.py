"""Backends: one interface (`base.Backend`) between the gateway's routes and every serving stack."""
