"""headkit.bench."""
