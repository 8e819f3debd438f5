"""headkit.analysis."""
