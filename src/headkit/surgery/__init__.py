"""headkit.surgery."""
