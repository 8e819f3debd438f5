"""headkit.models."""
