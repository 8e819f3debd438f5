"""headkit.layers."""
