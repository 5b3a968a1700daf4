"""partitioners."""
