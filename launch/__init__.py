"""vitscale: launch."""
