"""A faithful simulated accelerator node (`zml sim`)."""
