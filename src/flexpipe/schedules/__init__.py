"""The schedule library."""
