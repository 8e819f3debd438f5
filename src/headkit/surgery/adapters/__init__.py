"""headkit.surgery.adapters."""
